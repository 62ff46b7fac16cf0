"""flywheel.pareto: hand-worked fronts and crowding, the fast 2-objective sort against the generic
one, every pair rule, per-trajectory ranks, and group selection with its post-filter."""

import numpy as np
import polars as pl
import pytest

from data_contracts import table_from_rows, trajectories
from flywheel.pareto import (
    build_pairs,
    crowding_distance,
    fronts_2d,
    nondominated_fronts,
    select_by_fronts,
    select_groups,
    trajectory_ranks,
)
from flywheel.trajectory import Trajectory


def episode(
    task,
    sample_idx=0,
    reward=0.0,
    turns=2,
    *,
    end_user=True,
    source="explore",
    tool_calls=0,
    tokens=None,
    success=None,
    env="arith",
):
    """A trajectory row: instruction, Ok., first observation, then ``turns`` (action, observation)
    exchanges; ``end_user=False`` drops the last observation. Turn i's ids are [100 + i]."""
    msgs = [
        {"role": "user", "content": f"solve {task}", "loss": False},
        {"role": "assistant", "content": "Ok.", "loss": False},
        {"role": "user", "content": "obs 0", "loss": False},
    ]
    for i in range(turns):
        msgs.append({"role": "assistant", "content": f"act {i}", "loss": True})
        msgs.append({"role": "user", "content": f"obs {i + 1}", "loss": False})
    if not end_user and turns:
        msgs.pop()
    generated = source != "expert"
    return {
        "task_id": task,
        "env": env,
        "split": "train",
        "round": 1,
        "policy": "oracle" if not generated else "sft-abc",
        "source": source,
        "sample_idx": sample_idx if generated else 0,
        "messages": msgs,
        "reward": float(reward),
        "success": bool(reward >= 1.0) if success is None else success,
        "steps": turns,
        "tool_calls": tool_calls,
        "tool_errors": 0,
        "tool_ok": tool_calls,
        "invalid_actions": 0,
        "tokens": 10 * turns if tokens is None else tokens,
        "finish_reason": "done",
        "seed": 0,
        "turn_token_ids": [[100 + i] for i in range(turns)] if generated else [],
        "turn_logprobs": [[-0.5] for _ in range(turns)] if generated else [],
    }


def frame(rows):
    return pl.from_arrow(table_from_rows(trajectories.CONTRACT, rows))


EMPTY_EXPERT = frame([episode("none", source="expert")]).clear()


def roles(messages):
    return [m["role"] for m in messages]


# -- fronts and crowding ---------------------------------------------------------------------------

# Both objectives maximised. Worked by hand:
#   A(5,0) B(4,2) C(2,3) G(0,4): nobody beats any of them on both -> front 1.
#   D(3,1) is dominated by B(4,2); H(1,2) by C(2,3) (and B); D and H do not dominate each other
#   -> front 2.  E(1,1) and its duplicate I(1,1) are dominated by D and H -> front 3 (equal points
#   never dominate each other, so they share a front).
# Crowding in front 1: on x1 the order is G0 C2 B4 A5 (range 5): C gets (4-0)/5 = 0.8, B (5-2)/5
#   = 0.6; on x2 the order is A0 B2 C3 G4 (range 4): B gets (3-0)/4 = 0.75, C (4-2)/4 = 0.5.
#   B = 1.35, C = 1.3; A and G are boundaries (inf). Fronts of one or two points are all inf.
NAMES = list("ABCGDHEI")
POINTS = np.array([[5, 0], [4, 2], [2, 3], [0, 4], [3, 1], [1, 2], [1, 1], [1, 1]], float)
FRONTS = [1, 1, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize("sort", [nondominated_fronts, lambda p: fronts_2d(p[:, 0], p[:, 1])])
def test_fronts_hand_example(sort):
    assert sort(POINTS).tolist() == FRONTS


def test_crowding_hand_example():
    d = dict(zip(NAMES, crowding_distance(POINTS, np.array(FRONTS)), strict=True))
    assert d["A"] == d["G"] == np.inf
    assert d["B"] == pytest.approx(1.35) and d["C"] == pytest.approx(1.3)
    assert all(d[n] == np.inf for n in "DHEI")


def test_crowding_flat_objective_adds_nothing():
    # x2 is 1 for all three: its range is 0, so the middle point gets only its x1 share 2/2 = 1.
    pts = np.array([[0, 1], [1, 1], [2, 1]], float)
    assert crowding_distance(pts, np.ones(3, int)).tolist() == [np.inf, 1.0, np.inf]


@pytest.mark.parametrize(
    ("budget", "picked"),
    [
        (3, "AGB"),
        (4, "AGBC"),
        (5, "AGBCD"),
        (6, "AGBCDH"),
        (7, "AGBCDHE"),
        (None, "AGBCDHEI"),
        (0, ""),
    ],
)
def test_selection_fills_front_by_front_then_crowding(budget, picked):
    # Budget 3 cuts front 1: the boundaries A and G (inf) go first, then B (1.35) before C (1.3).
    # Front 2 (D, H) and front 3 (E, I) are all inf: ties keep the input order.
    _, _, order = select_by_fronts(POINTS, budget)
    assert "".join(NAMES[i] for i in order) == picked


@pytest.mark.parametrize("seed", range(6))
def test_fast_2d_sort_matches_generic(seed):
    rng = np.random.default_rng(seed)
    n = 300
    # odd seeds: few distinct values, so many ties and duplicates, like real group variances
    pts = rng.integers(0, 6, size=(n, 2)).astype(float) if seed % 2 else rng.random((n, 2))
    assert fronts_2d(pts[:, 0], pts[:, 1]).tolist() == nondominated_fronts(pts).tolist()


def test_generic_sort_three_objectives():
    # (1,1,1) dominates (1,1,0) dominates (0,1,0); (0,0,2) is beaten by nobody.
    pts = np.array([[1, 1, 0], [0, 1, 0], [1, 1, 1], [0, 0, 2]], float)
    assert nondominated_fronts(pts).tolist() == [2, 3, 1, 1]


# -- per-trajectory Pareto rank --------------------------------------------------------------------


def test_trajectory_ranks_per_task():
    rows = [
        # task a, (reward up, tool calls down, tokens down):
        episode("a", 0, 1.0, tool_calls=2, tokens=100),  # nobody is better everywhere -> 1
        episode("a", 1, 1.0, tool_calls=1, tokens=200),  # fewer calls than a0, more tokens -> 1
        episode("a", 2, 1.0, tool_calls=3, tokens=300),  # a0 is better on both -> 2
        episode("a", 3, 0.0, tool_calls=0, tokens=50),  # worst reward but cheapest -> 1
        # task b, 3 samples: b1 dominates b0 dominates b2 (a chain) -> 2, 1, 3
        episode("b", 0, 0.5, tool_calls=1, tokens=10),
        episode("b", 1, 0.5, tool_calls=1, tokens=5),
        episode("b", 2, 0.2, tool_calls=1, tokens=10),
        # task c: two identical samples share rank 1; a lone task d is rank 1
        episode("c", 0, 0.0, tool_calls=1, tokens=10),
        episode("c", 1, 0.0, tool_calls=1, tokens=10),
        episode("d", 0, 0.0, tool_calls=9, tokens=999),
    ]
    # shuffled rows: ranks stay aligned with the input order
    perm = [5, 0, 9, 3, 7, 1, 8, 2, 6, 4]
    ranks = trajectory_ranks(frame([rows[i] for i in perm]))
    expected = [1, 1, 2, 1, 2, 1, 3, 1, 1, 1]
    assert ranks.tolist() == [expected[i] for i in perm]


# -- pairs ------------------------------------------------------------------------------------------


def pairs_of(explore_rows, expert_rows, **kw):
    kw.setdefault("best_worst_pairs", False)
    expert = frame(expert_rows) if expert_rows else EMPTY_EXPERT
    return build_pairs(frame(explore_rows), expert, **kw).to_dicts()


def test_pred_below_gold_chosen_is_expert():
    [p] = pairs_of(
        [episode("t", 3, 0.0, turns=2)], [episode("t", reward=1.0, turns=1, source="expert")]
    )
    assert p["kind"] == "expert"
    assert (p["chosen_source"], p["chosen_sample_idx"], p["chosen_reward"]) == ("expert", -1, 1.0)
    assert (p["rejected_source"], p["rejected_sample_idx"], p["rejected_reward"]) == (
        "explore",
        3,
        0.0,
    )
    assert (
        roles(p["prompt"]) == ["user", "assistant", "user"] and p["prompt"][1]["content"] == "Ok."
    )
    # both end on an assistant turn: the trailing observations are cut
    assert roles(p["chosen"]) == ["assistant"]
    assert roles(p["rejected"]) == ["assistant", "user", "assistant"]
    assert p["chosen_turn_token_ids"] == [] and p["rejected_turn_token_ids"] == [[100], [101]]
    assert p["policy"] == "sft-abc"


def test_pred_above_gold_chosen_is_explored():
    [p] = pairs_of(
        [episode("t", 1, 0.8, turns=1)], [episode("t", reward=0.5, turns=2, source="expert")]
    )
    assert (p["chosen_source"], p["chosen_sample_idx"], p["chosen_reward"]) == ("explore", 1, 0.8)
    assert (p["rejected_source"], p["rejected_reward"]) == ("expert", 0.5)
    assert p["chosen_turn_token_ids"] == [[100]] and p["rejected_turn_token_ids"] == []
    assert roles(p["rejected"])[-1] == "assistant"


def test_tie_gives_no_pair_and_missing_gold_reward_counts_one():
    expert = episode("t", reward=0.5, source="expert")
    assert pairs_of([episode("t", 0, 0.5)], [expert]) == []
    unknown = {**episode("u", source="expert"), "reward": None}
    assert pairs_of([episode("u", 0, 1.0)], [unknown]) == []  # r_gold = 1.0: a tie
    assert len(pairs_of([episode("u", 0, 0.9)], [unknown])) == 1
    assert pairs_of([episode("v", 0, 0.0)], [expert]) == []  # no expert for task v


def test_several_expert_rows_the_best_is_gold():
    experts = [episode("t", reward=0.5, source="expert"), episode("t", reward=1.0, source="expert")]
    [p] = pairs_of([episode("t", 0, 0.6)], experts)
    assert (p["chosen_reward"], p["rejected_reward"]) == (1.0, 0.6)


def test_k_samples_each_pair_with_the_expert():
    explore = [episode("t", i, r) for i, r in enumerate([0.0, 1.0, 0.0])]
    pairs = pairs_of(explore, [episode("t", reward=1.0, source="expert")])
    assert [p["rejected_sample_idx"] for p in pairs] == [0, 2]


@pytest.mark.parametrize(("extra", "kept_turns"), [(10, 7), (0, 2), (3, 4), (4, 4)])
def test_rejected_cut_to_expert_length_plus_extra_on_an_assistant_turn(extra, kept_turns):
    # Expert: 3 prompt messages + 2 exchanges = 7 messages. Explored: 3 + 2*20 = 43 messages,
    # assistant turns at positions 3, 5, 7, ... The rejected side keeps at most 7 + extra
    # messages, then backs off to its last assistant turn:
    #   extra=10: limit 17, assistants 3..15 -> 7 turns;  extra=0: limit 7, 3 and 5 -> 2 turns;
    #   extra=3: limit 10, 3..9 -> 4 turns (10 messages);  extra=4: limit 11 would end on the
    #   observation at 10, so it backs off to 9 -> the same 4 turns.
    expert = episode("t", reward=1.0, turns=2, source="expert")
    [p] = pairs_of([episode("t", 0, 0.0, turns=20)], [expert], cut_extra_messages=extra)
    assert roles(p["rejected"]) == ["assistant", "user"] * (kept_turns - 1) + ["assistant"]
    assert len(p["prompt"]) + len(p["rejected"]) <= 7 + extra
    assert p["rejected"][-1]["content"] == f"act {kept_turns - 1}"
    assert p["rejected_turn_token_ids"] == [[100 + i] for i in range(kept_turns)]
    assert roles(p["chosen"]) == ["assistant", "user", "assistant"]  # the expert is never cut


def test_turn_ids_follow_the_last_assistant_messages():
    # An engine that also generated the "Ok." turn stores 3 id lists for 3 assistant messages;
    # the prompt keeps "Ok.", so the continuation's ids start at the second list.
    row = {**episode("t", 0, 0.0, turns=2), "turn_token_ids": [[99], [100], [101]]}
    [p] = pairs_of([row], [episode("t", reward=1.0, turns=1, source="expert")])
    assert p["rejected_turn_token_ids"] == [[100], [101]]


def test_a_cut_with_ids_on_both_sides_keeps_the_kept_turns_ids():
    # "Ok." and the 6 turns generated: the prompt keeps [99] (pairs store no prompt ids: DPO
    # tokenizes the prompt from text), the cut (expert length 7 + 3 messages) keeps 4 turns and
    # their ids, and the 2 turns after the cut take theirs away.
    row = {**episode("t", 0, 0.0, turns=6), "turn_token_ids": [[99]] + [[100 + i] for i in range(6)],
           "turn_logprobs": [[-0.5]] * 7}  # fmt: skip
    expert = episode("t", reward=1.0, turns=2, source="expert")
    [p] = pairs_of([row], [expert], cut_extra_messages=3)
    assert p["rejected_turn_token_ids"] == [[100], [101], [102], [103]]
    # The same as cutting the trajectory by hand with Trajectory.split.
    prompt, rest = Trajectory.from_row(row).split(len(p["prompt"]))
    continuation, _ = rest.split(len(p["rejected"]))
    assert (prompt.turn_token_ids, continuation.messages) == ([[99]], p["rejected"])
    assert continuation.turn_token_ids == p["rejected_turn_token_ids"]


def test_cuts_agree_with_trajectory_split():
    """Every cut of build_pairs (vectorised) against Trajectory.split (per row), over rows that
    generated no, some or all of their turns and every cut length."""
    rows = {}
    for turns, generated in [(t, g) for t in range(1, 5) for g in range(t + 2)]:
        base = episode(f"t{turns}-{generated}", 0, 0.0, turns=turns)
        ids = [[200 + i] for i in range(generated)]
        rows[base["task_id"]] = base | {
            "turn_token_ids": ids,
            "turn_logprobs": [[-1.0]] * generated,
        }
    experts = [episode(task, reward=1.0, turns=1, source="expert") for task in rows]
    both_sides = 0
    for extra in range(8):
        for p in pairs_of(list(rows.values()), experts, cut_extra_messages=extra):
            _, rest = Trajectory.from_row(rows[p["task_id"]]).split(len(p["prompt"]))
            continuation, after = rest.split(len(p["rejected"]))
            assert continuation.messages == p["rejected"]
            assert continuation.turn_token_ids == p["rejected_turn_token_ids"]
            both_sides += bool(continuation.turn_token_ids and after.turn_token_ids)
    assert both_sides >= 10  # cuts with generated turns on both sides are among them


def test_pair_dropped_when_a_side_has_no_assistant_turn():
    # An explored episode that died right after the first observation has nothing to train on.
    assert (
        pairs_of([episode("t", 0, 0.0, turns=0)], [episode("t", reward=1.0, source="expert")]) == []
    )


def best_worst(rows, **kw):
    return pairs_of(rows, [], expert_pairs=False, best_worst_pairs=True, **kw)


def test_best_worst_margin_is_strict():
    rows = [episode("t", 0, 0.2), episode("t", 1, 0.5), episode("t", 2, 0.5)]
    assert best_worst(rows, margin=0.3) == []  # 0.5 - 0.2 is not > 0.3
    [p] = best_worst(rows, margin=0.25)
    assert p["kind"] == "best_worst"
    assert (p["chosen_reward"], p["rejected_reward"], p["rejected_sample_idx"]) == (0.5, 0.2, 0)
    assert best_worst([episode("u", i, 0.7) for i in range(3)]) == []  # equal rewards: none
    assert best_worst([episode("v", 0, 1.0)]) == []  # a single sample


def test_best_worst_tie_breaks():
    rows = [
        episode(
            "t", 0, 1.0, tool_calls=3, tokens=100
        ),  # dominated by t1 (same tokens, fewer calls)
        episode("t", 1, 1.0, tool_calls=1, tokens=100),
        episode("t", 2, 1.0, tool_calls=0, tokens=150),
        episode("t", 3, 0.0, tool_calls=1, tokens=40),
        episode("t", 4, 0.0, tool_calls=1, tokens=80),  # most tokens among the failures
    ]
    [p] = best_worst(rows, prefer_pareto_rank=True)
    # rank 1 among the successes: t1 and t2; fewer tokens -> t1
    assert (p["chosen_sample_idx"], p["rejected_sample_idx"]) == (1, 4)
    assert p["chosen_turn_token_ids"] == [[100], [101]] and p["chosen_source"] == "explore"
    [p] = best_worst(rows, prefer_pareto_rank=False)
    assert (p["chosen_sample_idx"], p["rejected_sample_idx"]) == (
        0,
        4,
    )  # tokens tie -> lowest index


def test_both_kinds_together_and_nothing_when_both_off():
    explore = [episode("t", 0, 0.0), episode("t", 1, 1.0)]
    expert = [episode("t", reward=1.0, source="expert")]
    pairs = pairs_of(explore, expert, best_worst_pairs=True)
    assert sorted(p["kind"] for p in pairs) == ["best_worst", "expert"]
    assert pairs_of(explore, expert, expert_pairs=False) == []


# -- group selection --------------------------------------------------------------------------------


def group(task, rewards, calls=None, successes=None, env="arith"):
    calls = calls or [0] * len(rewards)
    successes = successes or [r >= 1.0 for r in rewards]
    return [
        episode(task, i, r, tool_calls=c, success=s, env=env)
        for i, (r, c, s) in enumerate(zip(rewards, calls, successes, strict=True))
    ]


def test_post_filter_binary_and_graded():
    rows = (
        group("bin-mixed", [1, 0, 1, 0])
        + group("bin-all-win", [1, 1, 1, 1])
        + group("bin-all-lose", [0, 0, 0, 0])
        + group("graded-ok", [0.8, 0.3], env="wiki")
        + group("graded-low", [0.7, 0.2], env="wiki")  # nothing >= 0.75
        + group("graded-high", [0.9, 0.76], env="wiki")  # nothing < 0.75
        + group("graded-edge", [0.75, 0.74], env="wiki")  # >= is inclusive, < is strict
        + group("graded-flat", [0.5, 0.5], env="wiki")
    )
    out = select_groups(frame(rows), budget=None)
    eligible = set(out.filter(pl.col("eligible"))["task_id"])
    assert eligible == {"bin-mixed", "graded-ok", "graded-edge"}
    assert set(out.filter(pl.col("selected"))["task_id"]) == eligible
    assert out.filter(~pl.col("eligible"))["front"].null_count() == 5
    assert (
        select_groups(frame(rows), budget=None, graded_threshold=0.7)
        .filter(pl.col("eligible"))["task_id"]
        .to_list()
        .count("graded-low")
        == 1
    )


def test_group_objectives_are_population_variances():
    out = select_groups(frame(group("g", [1, 0, 0, 0], calls=[0, 0, 4, 4])), budget=None)
    # success 1/4: p(1-p) = 3/16; tool calls {0,0,4,4}: mean 2, mean square 8 -> 8 - 4 = 4
    assert out["x2"].item() == 3 / 16 and out["x1"].item() == 4.0
    assert out["n"].item() == 4 and out["mean_reward"].item() == 0.25
    assert out["sample_idx"].item().to_list() == [0, 1, 2, 3]


def test_selection_front_order_and_budget():
    # (x1, x2) per group, K = 4 binary groups:
    #   g2 = (4, 3/16) and g4 = (1, 4/16) beat each other nowhere: front 1;
    #   g1 = (0, 4/16) is dominated by g4, g5 = (2.75, 3/16) by g2, not by each other: front 2;
    #   g3 = (0, 3/16) is dominated by g1 (and g5): front 3.
    rows = (
        group("g1", [1, 1, 0, 0], calls=[0, 0, 0, 0])  # x1 0,    x2 .25
        + group("g2", [1, 0, 0, 0], calls=[0, 0, 4, 4])  # x1 4,    x2 .1875
        + group("g3", [1, 0, 0, 0], calls=[0, 0, 0, 0])  # x1 0,    x2 .1875
        + group("g4", [1, 1, 0, 0], calls=[0, 0, 2, 2])  # x1 1,    x2 .25
        + group("g5", [1, 0, 0, 0], calls=[0, 0, 2, 4])  # x1 2.75, x2 .1875
    )
    out = select_groups(frame(rows), budget=3)
    assert dict(zip(out["task_id"], out["front"], strict=True)) == {
        "g2": 1,
        "g4": 1,
        "g1": 2,
        "g5": 2,
        "g3": 3,
    }
    # fronts of two points are all boundary (inf): ties go in (env, task_id) order
    assert out["task_id"].to_list() == ["g2", "g4", "g1", "g5", "g3"]
    assert out["selected"].to_list() == [True, True, True, False, False]
    assert select_groups(frame(rows), budget=1)["selected"].sum() == 1
    assert select_groups(frame(rows), budget=100)["selected"].sum() == 5


def test_budget_counts_groups_after_the_filter():
    # 3 flat groups sort first by task id, but the filter removes them before the budget applies
    rows = (
        group("a", [1, 1])
        + group("b", [0, 0])
        + group("c", [1, 1])
        + group("d", [1, 0])
        + group("e", [0, 1])
    )
    out = select_groups(frame(rows), budget=2)
    assert set(out.filter(pl.col("selected"))["task_id"]) == {"d", "e"}


def without_ack(row: dict) -> dict:
    """An episode whose opening is one user message (no "Ok."): a suite or imported data with
    another conversation start."""
    return {**row, "messages": [row["messages"][0], *row["messages"][3:]]}


def test_the_prompt_is_the_opening_before_the_first_trained_turn():
    explored = without_ack(episode("t", 0, 0.0, turns=2))
    [p] = pairs_of([explored], [without_ack(episode("t", reward=1.0, turns=1, source="expert"))])
    assert roles(p["prompt"]) == ["user"]
    assert roles(p["chosen"]) == ["assistant"] and roles(p["rejected"]) == roles(
        explored["messages"][1:4]
    )
    assert p["rejected_turn_token_ids"] == [[100], [101]]
    # A best-vs-worst pair of two such samples has the same one-message prompt.
    samples = [without_ack(episode("u", i, r, turns=1)) for i, r in enumerate([1.0, 0.0])]
    [q] = pairs_of(samples, [], best_worst_pairs=True, expert_pairs=False)
    assert roles(q["prompt"]) == ["user"] and roles(q["chosen"]) == ["assistant"]
