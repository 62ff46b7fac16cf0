"""flywheel.reflect: the cut point (step hint after the first flawed step, trajectory hint
without one), the hinted prefix's loss flags, and ``evolve`` on real craft envs with a scripted
policy that plays the expert's plan: recovered on the first attempt, on the second (a failed
continuation reflected on again), or not at all; loss flags and stored ids of the rows kept."""

from __future__ import annotations

import pytest

from flywheel.agent import Episode, replay
from flywheel.engines.base import Chat, Generation, SamplingParams, opened
from flywheel.envs.arith import ArithSuite
from flywheel.envs.craft import CraftSuite, action_line
from flywheel.model import train_tokenizer
from flywheel.reflect import Cut, cut_point, evolve, hinted, pick_hint

SUITE = CraftSuite(depth_weights=(1, 0, 0, 0), min_distractors=0, max_distractors=0, max_count=1)
TASKS = SUITE.tasks("train", 4, seed=0)
HINT = SUITE.hints[0]
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=16)
BAD = "hello there"  # not an action: the env flags it invalid
OK = {"invalid": False, "error": False}


@pytest.fixture(scope="module")
def tokenizer():
    texts = [SUITE.instruction, HINT, BAD, "Invalid action. Use: get N ITEM, craft ITEM using "
             "N ITEM, N ITEM, or inventory.", "Inventory: Got Crafted empty."]  # fmt: skip
    for task in TASKS:
        texts += [task.prompt, *SUITE.expert(task)]
    return train_tokenizer(texts)


def trajectory(tokenizer, task, turns: list[str]) -> dict:
    """An explore-like row of ``turns`` played through a real env (each turn's ids stored)."""
    messages = [{"role": "user", "content": ""}, {"role": "assistant", "content": "Ok."},
                {"role": "user", "content": ""}]  # fmt: skip
    for turn in turns:
        messages += [{"role": "assistant", "content": turn}, {"role": "user", "content": ""}]
    ids = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in turns]
    ep = replay(SUITE, task, messages, ids, [[-1.0] * len(t) for t in ids], sample_idx=1, seed=7)
    ep.finish_reason = ep.finish_reason or "max_steps"
    return ep.row("craft")


# -- the cut ---------------------------------------------------------------------------------------


def test_cut_point_after_the_first_flawed_step():
    infos = [OK, {"invalid": True}, {"error": True}, OK]
    assert cut_point(infos, ended=False) == Cut(keep=2, flawed=1)
    assert cut_point(infos, ended=False).kind == "step"
    assert cut_point(infos, ended=False, start=2) == Cut(keep=3, flawed=2)  # a later attempt
    assert cut_point([OK, {"lost_progress": True}], ended=False) == Cut(keep=2, flawed=1)
    assert cut_point([OK, {"tool_error": True}], ended=True) == Cut(keep=1)  # no state after it


def test_cut_point_without_a_flawed_step_is_the_trajectory_hint():
    assert cut_point([OK, OK, OK], ended=True) == Cut(keep=2)  # the final answer dropped
    assert cut_point([OK, OK, OK], ended=False).kind == "trajectory"
    assert cut_point([OK, OK, OK], ended=False) == Cut(keep=3)  # cut at max_steps: all kept
    assert cut_point([OK], ended=True) == Cut(keep=0)  # the hint right after the task
    assert cut_point([], ended=False) == Cut(keep=0)
    assert cut_point([{"invalid": True}, OK], ended=False, start=1) == Cut(keep=2)


def test_step_hint_keeps_the_flawed_step_and_its_observation_untrained(tokenizer):
    task = TASKS[0]
    plan = SUITE.expert(task)
    row = trajectory(tokenizer, task, [plan[0], BAD, plan[1]])
    original = replay(SUITE, task, row["messages"], row["turn_token_ids"])
    cut = cut_point(original.infos, ended=original.ended)
    assert cut == Cut(keep=2, flawed=1)
    opening = tokenizer.encode(HINT, add_special_tokens=False)
    ep = hinted(
        replay(SUITE, task, row["messages"], row["turn_token_ids"], steps=cut.keep,
               keep_open=True),
        opening,
    )  # fmt: skip
    try:
        assert ep.messages == [{**m, "loss": False} for m in row["messages"][:7]]
        assert ep.messages[5]["content"] == BAD and ep.messages[6]["content"].startswith("Invalid")
        assert ep.turn_token_ids == row["turn_token_ids"][:2] and ep.opening == opening
        chat = ep.chat()
        assert chat.opening == opening and chat.messages[-1]["role"] == "user"
        # the env is at the cut: the next step answers as after the flawed step
        assert (
            ep.env is not None
            and ep.env.step(plan[1])[0] == f"Got 1 {plan[1].split()[-2]} {plan[1].split()[-1]}."
        )
    finally:
        ep.close()


def test_trajectory_hint_drops_the_final_answer():
    suite = ArithSuite()
    task = suite.tasks("train", 1, seed=0)[0]
    call = "<python>print(1 + 1)</python>"
    messages = [{"role": "user", "content": ""}, {"role": "assistant", "content": "Ok."},
                {"role": "user", "content": ""}, {"role": "assistant", "content": call},
                {"role": "user", "content": ""}, {"role": "assistant", "content": "<answer>-1</answer>"}]  # fmt: skip
    played = replay(suite, task, messages)
    assert played.finish_reason == "done" and not played.success and played.infos[0]["tool_ok"]
    cut = cut_point(played.infos, ended=played.ended)
    assert cut == Cut(keep=1)
    ep = hinted(replay(suite, task, messages, steps=cut.keep, keep_open=True), [5])
    try:
        assert [m["content"] for m in ep.messages[3:]] == [call, "2"]  # hint after the observation
        assert not any(m["loss"] for m in ep.messages) and ep.opening == [5]
    finally:
        ep.close()


def test_pick_hint_is_stable_and_uses_the_whole_hint():
    hints = ("Wait, one.", "Wait, two.")
    assert pick_hint(hints, "t", 0, 1) == pick_hint(hints, "t", 0, 1) in hints
    assert {pick_hint(hints, "t", k, 0) for k in range(20)} == set(hints)
    with pytest.raises(ValueError, match="no hints"):
        pick_hint((), "t")


# -- evolve ----------------------------------------------------------------------------------------


class PlanEngine:
    """A scripted policy for craft: each turn takes the next step of the task's expert plan
    (the plan steps the chat's turns already took are skipped), or says ``hello there`` until
    the chat holds ``hints`` hinted turns. It honours a chat's opening as real engines do."""

    def __init__(self, tokenizer, tasks=TASKS, *, hints: int = 1) -> None:
        self.tokenizer, self.hints = tokenizer, hints
        self.batches: list[int] = []
        self.plans = {t.prompt: SUITE.expert(t) for t in tasks}

    def generate(self, chats: list[Chat], params: SamplingParams) -> list[Generation]:
        self.batches.append(len(chats))
        return [self._turn(chat) for chat in chats]

    def _turn(self, chat: Chat) -> Generation:
        plan = self.plans[chat.messages[2]["content"]]
        turns = [m["content"] for m in chat.messages[3:] if m["role"] == "assistant"]
        hinted = sum(t.startswith(HINT) for t in turns) + bool(chat.opening)
        taken = 0
        for turn in turns:
            if taken < len(plan) and action_line(turn) == plan[taken]:
                taken += 1
        text = BAD if hinted < self.hints else plan[taken]
        text = " " + text if chat.opening else text
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        gen = Generation(text, ids, [-0.5] * len(ids), "stop")
        return opened(gen, chat.opening, self.tokenizer)


def run_evolve(tokenizer, rows, engine, **kw):
    encode = lambda hint: tokenizer.encode(hint, add_special_tokens=False)  # noqa: E731
    kw.setdefault("max_evolve_times", 3)
    return evolve(engine, SUITE, [(TASKS[i], r) for i, r in rows], encode=encode,
                  sampling=SAMPLING, max_steps=4, seed=3, **kw)  # fmt: skip


def test_a_hinted_continuation_that_succeeds_is_kept_with_its_loss_flags(tokenizer):
    plan = SUITE.expert(TASKS[0])
    row = trajectory(tokenizer, TASKS[0], [plan[0], BAD, BAD])
    engine = PlanEngine(tokenizer)
    (ref,) = run_evolve(tokenizer, [(0, row)], engine)
    assert ref.attempts == 1 and ref.skipped is None and ref.recovered is not None
    ep: Episode = ref.recovered
    assert ep.success and ep.finish_reason == "done" and ep.sample_idx == 1
    msgs = ep.messages
    assert msgs[:7] == [{**m, "loss": False} for m in row["messages"][:7]]  # flawed prefix
    hint_turn = msgs[7]
    assert hint_turn["loss"] and hint_turn["content"] == f"{HINT} {plan[1]}"
    assert [m["content"] for m in msgs[9::2]] == plan[2:] and all(m["loss"] for m in msgs[9::2])
    assert not any(m["loss"] for m in msgs if m["role"] == "user")
    hint_ids = tokenizer.encode(HINT, add_special_tokens=False)
    assert ep.turn_token_ids[:2] == row["turn_token_ids"][:2]  # the prefix's ids kept
    assert ep.turn_token_ids[2][: len(hint_ids)] == hint_ids
    assert ep.turn_logprobs[2] == [0.0] * len(hint_ids) + [-0.5] * (
        len(ep.turn_token_ids[2]) - len(hint_ids)
    )
    assert len(ep.turn_token_ids) == 2 + len(plan) - 1  # every generated turn has its ids
    assert ep.steps == 2 + len(plan) - 1 and ep.invalid_actions == 1


def test_a_failed_continuation_is_reflected_on_again(tokenizer):
    plan = SUITE.expert(TASKS[1])
    rows = [(1, trajectory(tokenizer, TASKS[1], [BAD, BAD, BAD]))]
    (twice,) = run_evolve(tokenizer, rows, PlanEngine(tokenizer, hints=2))
    assert twice.attempts == 2 and twice.recovered is not None
    msgs = twice.recovered.messages
    hinted_turns = [i for i, m in enumerate(msgs) if m["content"].startswith(HINT)]
    assert len(hinted_turns) == 2  # the first attempt's hinted turn is now flawed prefix
    first, second = hinted_turns
    assert (
        first == 5 and not msgs[first]["loss"] and msgs[first + 1]["content"].startswith("Invalid")
    )
    assert second == first + 2 and all(m["loss"] for m in msgs[second:] if m["role"] == "assistant")
    assert not any(m["loss"] for m in msgs[:second])
    assert msgs[second]["content"] == f"{HINT} {plan[0]}"

    (never,) = run_evolve(tokenizer, rows, PlanEngine(tokenizer, hints=2), max_evolve_times=1)
    assert never.attempts == 1 and never.recovered is None and never.skipped is None


def test_shard_continues_in_one_engine_call_per_step_and_skips_what_does_not_replay(tokenizer):
    rows = [(i, trajectory(tokenizer, TASKS[i], [BAD])) for i in range(3)]
    rows[2][1]["messages"][4]["content"] = "not what the env said"  # another env's episode
    engine = PlanEngine(tokenizer)
    results = run_evolve(tokenizer, rows, engine)
    assert [r.skipped for r in results] == [None, None, "the replay diverged"]
    assert all(r.recovered is not None for r in results[:2]) and results[2].attempts == 0
    longest = max(len(SUITE.expert(TASKS[i])) for i in range(2))
    assert engine.batches[0] == 2 and len(engine.batches) == longest
    with pytest.raises(ValueError, match="env craft gives no hints"):
        bare = CraftSuite()
        bare.hints = ()  # type: ignore[misc]
        evolve(engine, bare, [], encode=list, sampling=SAMPLING, max_steps=2)
