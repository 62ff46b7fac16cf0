"""flywheel.splice: pair selection on hand-built trees, the rule and judge verifiers, and the
spliced trajectory's messages, loss flags and stored ids (checked through Trajectory.encode)."""

from __future__ import annotations

import pytest

from data_contracts import table_from_rows, trajectories
from flywheel.mcts import Child, Node, Tree, backup, paths, settle
from flywheel.splice import (
    REVISION_THOUGHTS,
    divergence,
    good_paths,
    judge_chat,
    judge_flags,
    judge_nodes,
    parse_judgement,
    path_row,
    pick_thought,
    revision_turn,
    rule_flags,
    select_revisions,
    splice,
    unspellable,
)
from flywheel.trajectory import Trajectory

OPENING = [
    {"role": "user", "content": "Craft items from recipes.", "loss": False},
    {"role": "assistant", "content": "Ok.", "loss": False},
    {"role": "user", "content": "Goal: craft 1 torch.", "loss": False},
]


def grow(
    parent: Node,
    action: str,
    observation: str,
    *,
    ids: tuple[int, ...] = (),
    info: dict | None = None,
    done: bool = False,
    reward: float = 0.0,
    max_depth: int = 10,
) -> Node:
    """A stepped child of ``parent``, backed up when terminal, as the search would leave it."""
    node = parent.tree.add(
        parent,
        Child(f"Thought: next.\nAction: {action}", list(ids), [-0.5] * len(ids), action=action),
    )
    info = dict(info or {})
    if done:
        info["success"] = reward >= 1.0
    settle(node, (observation, reward, done, info), max_depth)
    if node.terminal:
        backup(node, node.reward)
    return node


@pytest.fixture
def craft_tree():
    """root -> a (get log) -> b (invalid craft) -> b2 (cut off at max depth: 0)
                   -> g (get coal) -> g2 (craft torch: 1)
    -> c (lost progress, episode over: 0)"""
    tree = Tree("craft-7:0", "craft-7", "craft", seed=7, opening=OPENING)
    a = grow(tree.root, "get 1 log", "Got 1 log.", ids=(11, 12))
    b = grow(a, "craft torch using 2 log", "Invalid: you have 1 log.", ids=(21,),
             info={"invalid": True, "error": "missing ingredients"})  # fmt: skip
    b2 = grow(b, "inventory", "log: 1", ids=(22,), max_depth=3)
    g = grow(a, "get 1 coal", "Got 1 coal.", ids=(31,))
    g2 = grow(g, "craft torch using 1 log, 1 coal", "Crafted 1 torch.", ids=(32, 33),
              done=True, reward=1.0, info={"progress": 1.0})  # fmt: skip
    c = grow(tree.root, "craft stick using 1 log", "You lost your log.", ids=(41,),
             done=True, info={"lost_progress": True})  # fmt: skip
    return tree, {"a": a, "b": b, "b2": b2, "g": g, "g2": g2, "c": c}


def test_good_paths_and_pairs(craft_tree):
    tree, n = craft_tree
    assert [p[-1] for p in paths(tree)] == [n["b2"], n["g2"], n["c"]]
    assert tree.root.value == pytest.approx(1 / 3)
    assert [p[-1] for p in good_paths(tree, alpha=0.5)] == [n["g2"]]
    assert good_paths(tree, alpha=1.0) == []  # a good leaf must exceed alpha
    revisions = select_revisions(tree, alpha=0.5, beta=0.2)
    assert [(r.bad[-1], r.good[-1], r.cut, r.divergence) for r in revisions] == [
        (n["b2"], n["g2"], 1, 1),  # b, the invalid craft, is the sibling of g
        (n["c"], n["g2"], 0, 0),
    ]
    assert select_revisions(tree, alpha=0.5, beta=1.0) == []  # gap 1.0 is not > 1.0
    n["g2"].value = 0.0  # a tree whose root value is 0 is skipped
    tree.root.value = 0.0
    assert select_revisions(tree) == []


def test_rule_flags_read_env_signals():
    tree = Tree("t", "task", "craft")
    infos = [
        {"invalid": True},
        {"error": "no recipe for stick", "error_kind": "unknown_recipe"},
        {"lost_progress": True, "progress": 0.25},
        {"tool_error": True},
        {"progress": 0.5},
        {"invalid": False, "error": "", "lost_progress": False},
        {},
    ]
    nodes = [tree.add(tree.root, Child(f"turn {i}")) for i in range(len(infos))]
    for node, info in zip(nodes, infos, strict=True):
        node.info = info
    assert rule_flags(nodes) == [True, True, True, True, False, False, False]


@pytest.fixture
def deep_tree():
    """root -> x -> y -> e (invalid) -> e2 (done, 0)
             -> s -> (done, 1)          the sibling of the error
    -> z (done, 1)                        a good path that parts at the root"""
    tree = Tree("deep", "craft-1", "craft", opening=OPENING)
    x = grow(tree.root, "get 1 log", "Got 1 log.")
    y = grow(x, "get 1 log", "Got 2 logs.")
    e = grow(y, "craft plank using 3 log", "Invalid.", info={"invalid": True})
    e2 = grow(e, "give up", "Episode over.", done=True)
    s = grow(y, "craft plank using 2 log", "Crafted 1 plank.", done=True, reward=1.0)
    z = grow(tree.root, "get 1 plank", "Got 1 plank.", done=True, reward=1.0)
    return tree, {"x": x, "y": y, "e": e, "e2": e2, "s": s, "z": z}


def test_the_sibling_of_the_first_error_is_preferred(deep_tree):
    tree, n = deep_tree
    (rev,) = select_revisions(tree)
    assert rev.bad[-1] is n["e2"] and rev.good[-1] is n["s"]
    assert (rev.cut, rev.divergence) == (2, 2)
    z_path = next(p for p in paths(tree) if p[-1] is n["z"])
    assert divergence(rev.bad, z_path) == 0


def test_judge_verdicts_move_the_cut(deep_tree):
    tree, n = deep_tree
    assert judge_nodes(tree) == [n["x"], n["y"], n["e"], n["e2"]]
    verdicts = {n["x"].node_id: "bad", n["y"].node_id: "good", n["e"].node_id: "uncertain"}
    (rev,) = select_revisions(tree, flags=judge_flags(verdicts))
    # The judge blames the first step: the good path that parts at the root is the sibling.
    assert rev.good[-1] is n["z"] and (rev.cut, rev.divergence) == (0, 0)
    # No step judged bad: cut where the paths part, preferring the longest shared prefix.
    (rev,) = select_revisions(tree, flags=judge_flags({}))
    assert rev.good[-1] is n["s"] and rev.cut == 2


def test_judge_chat_and_parse(deep_tree):
    tree, n = deep_tree
    (message,) = judge_chat(n["e"])
    assert message["role"] == "user"
    text = message["content"]
    assert "Goal: craft 1 torch." in text
    assert (
        "Action: get 1 log\nObservation: Got 1 log.\nAction: get 1 log\nObservation: Got 2 logs."
        in text
    )
    assert "Action: craft plank using 3 log\nObservation: Invalid." in text
    assert "Judgement: Good" in text and "Judgement: Bad" in text
    assert "(none)" in judge_chat(n["x"])[0]["content"]
    assert parse_judgement("The craft lacks a log.\nJudgement: Bad") == "bad"
    assert parse_judgement("Judgement: good") == "good"
    assert parse_judgement("judgment: Uncertain.") == "uncertain"
    assert parse_judgement("Judgement: **Bad**") == "bad"
    assert parse_judgement("Judgement: Good. On reflection...\nJudgement: Bad") == "bad"
    assert parse_judgement("I think it is fine.") == "uncertain"


def test_splice_messages_loss_flags_and_ids(craft_tree, tokenizer):
    tree, n = craft_tree
    rev = select_revisions(tree)[0]
    text = revision_turn(REVISION_THOUGHTS[0], noop="inventory")
    assert text == f"Thought: {REVISION_THOUGHTS[0]}\nAction: inventory"
    row = splice(rev.bad, rev.good, rev.cut, text, revision_observation="log: 1", sample_idx=3)
    step = "Thought: next.\nAction: "
    assert row["messages"] == OPENING + [
        {"role": "assistant", "content": step + "get 1 log", "loss": False},
        {"role": "user", "content": "Got 1 log.", "loss": False},
        {"role": "assistant", "content": step + "craft torch using 2 log", "loss": False},
        {"role": "user", "content": "Invalid: you have 1 log.", "loss": False},
        {"role": "assistant", "content": text, "loss": True},
        {"role": "user", "content": "log: 1", "loss": False},
        {"role": "assistant", "content": step + "get 1 coal", "loss": True},
        {"role": "user", "content": "Got 1 coal.", "loss": False},
        {"role": "assistant", "content": step + "craft torch using 1 log, 1 coal", "loss": True},
    ]
    assert row["turn_token_ids"] == [[31], [32, 33]]
    assert row["turn_logprobs"] == [[-0.5], [-0.5, -0.5]]
    assert (row["reward"], row["success"], row["finish_reason"]) == (1.0, True, "done")
    assert (row["source"], row["sample_idx"], row["seed"], row["split"]) == (
        "revision",
        3,
        7,
        "train",
    )
    assert (row["steps"], row["invalid_actions"], row["tokens"]) == (5, 1, 6)
    table_from_rows(trajectories.CONTRACT, [{**row, "round": 1, "policy": "sft-abc"}])

    # Trained tokens: the revision turn from its text, then the stored ids of the two good turns.
    ids, mask = Trajectory.from_row(row).encode(tokenizer)
    runs, current = [], []
    for token, trained in zip(ids, mask, strict=True):
        if trained:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    revision_ids = tokenizer.encode(text, add_special_tokens=False)
    assert runs == [revision_ids + [runs[0][-1]], [31], [32, 33]]


def test_splice_of_a_path_that_parts_at_the_root(craft_tree):
    tree, n = craft_tree
    rev = select_revisions(tree)[1]
    row = splice(
        rev.bad,
        rev.good,
        rev.cut,
        "Thought: undo.\nAction: inventory",
        revision_observation="nothing",
    )
    roles_loss = [(m["role"], m["loss"]) for m in row["messages"][3:]]
    assert roles_loss == [
        ("assistant", False), ("user", False),  # c, its episode-ending observation kept
        ("assistant", True), ("user", False),  # revision
        ("assistant", True), ("user", False), ("assistant", True), ("user", False),
        ("assistant", True),  # a, g, g2: the whole good path
    ]  # fmt: skip
    assert row["messages"][4]["content"] == "You lost your log."
    assert row["turn_token_ids"] == [[11, 12], [31], [32, 33]]


def test_splice_rejects_a_cut_inside_the_shared_steps(craft_tree):
    tree, n = craft_tree
    rev = select_revisions(tree)[0]
    with pytest.raises(ValueError, match="cannot splice at step 0"):
        splice(rev.bad, rev.good, 0, "x", revision_observation="y")


def test_good_path_row(craft_tree):
    tree, n = craft_tree
    (good,) = good_paths(tree)
    row = path_row(good, sample_idx=1)
    assert [m["loss"] for m in row["messages"]] == [False] * 3 + [True, False, True, False, True]
    assert row["turn_token_ids"] == [[11, 12], [31], [32, 33]]
    assert (row["source"], row["reward"], row["steps"], row["tokens"]) == ("mcts", 1.0, 3, 5)
    table_from_rows(trajectories.CONTRACT, [{**row, "round": 1, "policy": "sft-abc"}])


def test_pick_thought_is_stable():
    assert pick_thought("craft-7:0", 0) == pick_thought("craft-7:0", 0)
    assert {pick_thought("tree", k) for k in range(40)} == set(REVISION_THOUGHTS)
    assert {pick_thought("tree", k, thoughts=("a b", "c")) for k in range(40)} == {"a b", "c"}


def test_unspellable_names_the_words_a_word_level_tokenizer_lacks():
    from flywheel.config import TinyModelConfig
    from flywheel.model import build_tiny_policy

    tokenizer, _ = build_tiny_policy(
        ["Looking at my last action, it was wrong."], TinyModelConfig(), 0
    )
    assert unspellable(tokenizer, ["My last action was wrong.", "it was"]) == ["My"]
    assert unspellable(tokenizer, ["my last action was wrong."]) == []
    assert unspellable(object(), ["anything at all"]) == []  # no unknown token: a byte-level BPE


def test_splice_thoughts_must_be_lines():
    from flywheel.config import ConfigError, load_config

    assert load_config(None, ["splice.thoughts=[I was wrong.]"]).splice.thoughts == ["I was wrong."]
    for bad in ("splice.thoughts=[]", "splice.thoughts=['']"):
        with pytest.raises(ConfigError, match="splice.thoughts: .*thought"):
            load_config(None, [bad])
