from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from flywheel.agent import Episode, drive, expert_episodes, replay, run_episodes
from flywheel.chat import encode_chat
from flywheel.engines.base import Chat, Generation, SamplingParams
from flywheel.engines.hf import HFEngine
from flywheel.envs.base import Task
from flywheel.trajectory import align_turn_ids

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=8)
ROW_KEYS = {
    "task_id", "env", "split", "sample_idx", "messages", "reward", "success", "steps", "tool_calls",
    "tool_errors", "tool_ok", "invalid_actions", "tokens", "finish_reason", "seed", "turn_token_ids",
    "turn_logprobs",
}  # fmt: skip


def task(task_id: str, prompt: str = "What is 37 + 12?", **meta) -> Task:
    return Task(
        task_id=task_id,
        env="fake",
        split="test",
        seed=0,
        difficulty=1,
        prompt=prompt,
        answer="49",
        meta=meta,
    )


class FakeEnv:
    """Tool calls print 49; an answer ends the episode; ``fail_on`` makes reset or step raise."""

    def __init__(self) -> None:
        self.closed = False
        self.task: Task | None = None

    def reset(self, task: Task) -> str:
        if task.meta.get("fail_on") == "reset":
            raise RuntimeError("reset broke")
        self.task = task
        return task.prompt

    def step(self, action: str):
        if self.task.meta.get("fail_on") == "step":
            raise RuntimeError("step broke")
        info = {"tool_call": False, "tool_error": False, "tool_ok": False, "invalid": False}
        if action.startswith("<python>"):
            error = "oops" in action
            info.update(tool_call=True, tool_error=error, tool_ok=not error)
            return ("Error: NameError" if error else "49"), 0.0, False, info
        if action.startswith("<answer>"):
            ok = action == f"<answer>{self.task.answer}</answer>"
            return "", float(ok), True, {**info, "success": ok}
        return "Invalid action", 0.0, False, {**info, "invalid": True}

    def close(self) -> None:
        self.closed = True


class FakeSuite:
    name = "fake"
    instruction = "Solve the task."

    def __init__(self) -> None:
        self.envs: list[FakeEnv] = []

    def tasks(self, split: str, n: int, seed: int) -> list[Task]:
        return [task(f"t{i}") for i in range(n)]

    def expert(self, task: Task) -> list[str]:
        if task.meta.get("fail_on") == "expert":
            raise ValueError("no oracle")
        return ["<python>print(37 + 12)</python>", f"<answer>{task.answer}</answer>"][
            : task.meta.get("script_len", 2)
        ]

    def make(self) -> FakeEnv:
        self.envs.append(FakeEnv())
        return self.envs[-1]


class FakeEngine:
    """Calls the tool, then answers; a task prompt containing "loop" keeps calling the tool."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def generate(self, chats: list[Chat], params: SamplingParams) -> list[Generation]:
        self.batches.append(len(chats))
        out = []
        for chat in chats:
            n_assistant = sum(m["role"] == "assistant" for m in chat.messages)
            assert (
                len(chat.turn_token_ids) == n_assistant and chat.turn_token_ids[0] == []
            )  # "Ok." from text
            looping = "loop" in chat.messages[2]["content"]
            text = (
                "<python>print(oops)</python>"
                if n_assistant == 1 or looping
                else "<answer>49</answer>"
            )
            ids = list(range(n_assistant, n_assistant + 3))
            out.append(
                Generation(text=text, token_ids=ids, logprobs=[-0.5] * 3, finish_reason="stop")
            )
        return out


def test_one_generate_call_per_step_for_all_live_episodes():
    suite, engine = FakeSuite(), FakeEngine()
    tasks = [task("a"), task("b", prompt="loop forever"), task("c")]
    rows = run_episodes(engine, suite, tasks, samples_per_task=2, sampling=SAMPLING, max_steps=4)
    assert engine.batches == [6, 6, 2, 2]  # the looping task's two samples live on alone
    assert [(r["task_id"], r["sample_idx"]) for r in rows] == [
        (t, k) for t in "abc" for k in (0, 1)
    ]
    assert all(set(r) == ROW_KEYS for r in rows)
    done, looping = rows[0], rows[2]
    assert (
        done["finish_reason"] == "done"
        and done["success"]
        and done["reward"] == 1.0
        and done["steps"] == 2
    )
    assert (done["tool_calls"], done["tool_errors"], done["tool_ok"], done["invalid_actions"]) == (
        1,
        1,
        0,
        0,
    )
    assert (
        looping["finish_reason"] == "max_steps"
        and looping["steps"] == 4
        and looping["reward"] == 0.0
    )
    assert not looping["success"] and looping["tool_calls"] == 4
    assert all(env.closed for env in suite.envs) and len(suite.envs) == 6


def test_message_layout_loss_and_turn_ids():
    row = run_episodes(FakeEngine(), FakeSuite(), [task("a")], sampling=SAMPLING, max_steps=5)[0]
    assert row["messages"] == [
        {"role": "user", "content": "Solve the task.", "loss": False},
        {"role": "assistant", "content": "Ok.", "loss": False},
        {"role": "user", "content": "What is 37 + 12?", "loss": False},
        {"role": "assistant", "content": "<python>print(oops)</python>", "loss": True},
        {"role": "user", "content": "Error: NameError", "loss": False},
        {"role": "assistant", "content": "<answer>49</answer>", "loss": True},
    ]  # the final observation of a finished episode is not a turn
    assert row["turn_token_ids"] == [[1, 2, 3], [2, 3, 4]]
    assert row["turn_logprobs"] == [[-0.5] * 3] * 2 and row["tokens"] == 6
    assert row["env"] == "fake" and row["split"] == "test"


def test_env_errors_end_only_that_episode():
    suite, progress = FakeSuite(), []
    tasks = [task("ok"), task("bad_step", fail_on="step"), task("bad_reset", fail_on="reset")]
    rows = run_episodes(
        FakeEngine(),
        suite,
        tasks,
        sampling=SAMPLING,
        max_steps=5,
        progress=lambda d, t: progress.append((d, t)),
    )
    ok, bad_step, bad_reset = rows
    assert ok["finish_reason"] == "done"
    assert bad_step["finish_reason"] == "error" and bad_step["steps"] == 1
    assert bad_step["messages"][-1] == {
        "role": "user",
        "content": "RuntimeError: step broke",
        "loss": False,
    }
    assert bad_reset["finish_reason"] == "error" and bad_reset["steps"] == 0
    assert [m["content"] for m in bad_reset["messages"]] == [
        "Solve the task.",
        "Ok.",
        "RuntimeError: reset broke",
    ]
    assert progress == [(1, 3), (2, 3), (3, 3)]
    assert all(env.closed for env in suite.envs)


def test_envs_are_closed_when_the_engine_fails():
    class Broken:
        def generate(self, chats, params):
            raise RuntimeError("engine down")

    suite = FakeSuite()
    with pytest.raises(RuntimeError, match="engine down"):
        run_episodes(Broken(), suite, [task("a"), task("b")], sampling=SAMPLING, max_steps=3)
    assert len(suite.envs) == 2 and all(env.closed for env in suite.envs)


def test_seeds_are_per_episode_and_stable():
    rows = run_episodes(
        FakeEngine(),
        FakeSuite(),
        [task("a"), task("b")],
        samples_per_task=2,
        sampling=SAMPLING,
        max_steps=1,
        seed=3,
    )
    again = run_episodes(
        FakeEngine(),
        FakeSuite(),
        [task("a"), task("b")],
        samples_per_task=2,
        sampling=SAMPLING,
        max_steps=1,
        seed=3,
    )
    assert [r["seed"] for r in rows] == [r["seed"] for r in again]
    assert len({r["seed"] for r in rows}) == 4


def test_expert_episodes_replay_the_oracle():
    suite = FakeSuite()
    tasks = [task("a"), task("short", script_len=1), task("broken", fail_on="expert")]
    good, short, broken = expert_episodes(suite, tasks, env_workers=2)
    assert good["finish_reason"] == "done" and good["success"] and good["steps"] == 2
    assert [m["content"] for m in good["messages"][3:]] == [
        "<python>print(37 + 12)</python>",
        "49",
        "<answer>49</answer>",
    ]
    assert good["turn_token_ids"] == [] and good["turn_logprobs"] == [] and good["tokens"] == 0
    assert short["finish_reason"] == "max_steps" and short["steps"] == 1 and not short["success"]
    assert (
        broken["finish_reason"] == "error"
        and broken["messages"][-1]["content"] == "ValueError: no oracle"
    )
    assert all(env.closed for env in suite.envs)


def test_with_the_hf_engine_stored_ids_rebuild_every_prompt(tiny_model, tokenizer):
    engine = HFEngine(tiny_model, tokenizer)
    rows = run_episodes(
        engine,
        FakeSuite(),
        [task("a"), task("b")],
        samples_per_task=2,
        sampling=SAMPLING,
        max_steps=2,
    )
    for row in rows:
        assert len(row["turn_token_ids"]) == row["steps"] == len(row["turn_logprobs"])
        assert [len(t) for t in row["turn_token_ids"]] == [len(lp) for lp in row["turn_logprobs"]]
        turns = align_turn_ids(row["messages"], row["turn_token_ids"])
        ids, mask = encode_chat(tokenizer, row["messages"], turns)
        assert sum(mask) == row["tokens"]  # every generated id is trained, nothing else


class SubmittingEngine(FakeEngine):
    """FakeEngine's answers, one chat at a time as futures (what a server engine offers)."""

    def __init__(self, fail_after: int | None = None) -> None:
        super().__init__()
        self.pool = ThreadPoolExecutor(max_workers=4)
        self.calls: list[tuple[str, float]] = []  # (task prompt, when)
        self.fail_after = fail_after

    def submit(self, chat: Chat, params: SamplingParams) -> Future[Generation]:
        self.calls.append((chat.messages[2]["content"], time.monotonic()))
        if self.fail_after is not None and len(self.calls) > self.fail_after:
            return self.pool.submit(self._fail)
        return self.pool.submit(lambda: self.generate([chat], params)[0])

    @staticmethod
    def _fail() -> Generation:
        raise RuntimeError("server gone")


class SlowEnv(FakeEnv):
    def step(self, action: str):
        if self.task is not None and "slow" in self.task.prompt:
            time.sleep(0.4)
        return super().step(action)


class SlowSuite(FakeSuite):
    def make(self) -> FakeEnv:
        self.envs.append(SlowEnv())
        return self.envs[-1]


def test_episodes_with_a_submitting_engine_match_the_lockstep_loop():
    tasks = [task("a"), task("b", prompt="loop forever"), task("c")]
    lockstep = run_episodes(
        FakeEngine(), FakeSuite(), tasks, samples_per_task=2, sampling=SAMPLING, max_steps=4
    )
    suite, engine = FakeSuite(), SubmittingEngine()
    each = run_episodes(engine, suite, tasks, samples_per_task=2, sampling=SAMPLING, max_steps=4)
    assert engine.batches == [1] * 16  # (2 + 4 + 2 turns) x 2 samples, one request each
    assert each == lockstep
    assert all(env.closed for env in suite.envs) and len(suite.envs) == 6


def test_episodes_with_a_submitting_engine_do_not_wait_for_slow_env_steps():
    tasks = [task("slow", prompt="slow one"), task("f1"), task("f2"), task("f3")]
    engine = SubmittingEngine()
    rows = run_episodes(engine, SlowSuite(), tasks, sampling=SAMPLING, max_steps=4, env_workers=4)
    assert [r["finish_reason"] for r in rows] == ["done"] * 4
    slow_second = [t for p, t in engine.calls if p == "slow one"][1]
    fast = [t for p, t in engine.calls if p != "slow one"]
    # Every fast episode played both its turns while the slow one's first env step ran.
    assert len(fast) == 6 and max(fast) < slow_second


def test_a_failed_generation_stops_the_call_and_closes_every_env():
    suite, engine = FakeSuite(), SubmittingEngine(fail_after=3)
    with pytest.raises(RuntimeError, match="server gone"):
        run_episodes(
            engine, suite, [task(f"t{i}") for i in range(3)], sampling=SAMPLING, max_steps=4
        )
    assert len(suite.envs) == 3 and all(env.closed for env in suite.envs)


# -- episodes from a prefix -----------------------------------------------------------------------


def test_replay_gives_the_same_episode_and_can_stop_at_a_step():
    suite = FakeSuite()
    (row,) = run_episodes(FakeEngine(), suite, [task("a")], sampling=SAMPLING, max_steps=5)
    again = replay(suite, task("a"), row["messages"], row["turn_token_ids"], row["turn_logprobs"])
    assert again.row("fake") == {**row, "seed": 0, "sample_idx": 0}
    assert again.infos == [
        {"tool_call": True, "tool_error": True, "tool_ok": False, "invalid": False},
        {"tool_call": False, "tool_error": False, "tool_ok": False, "invalid": False,
         "success": True},
    ]  # fmt: skip
    assert again.ended and again.env is None and suite.envs[-1].closed

    prefix = replay(suite, task("a"), row["messages"], row["turn_token_ids"], steps=1,
                    keep_open=True)  # fmt: skip
    assert prefix.steps == 1 and prefix.finish_reason is None and not prefix.ended
    assert prefix.messages == row["messages"][:5] and prefix.turn_token_ids == [[1, 2, 3]]
    assert prefix.env is suite.envs[-1] and not prefix.env.closed
    prefix.close()
    broken = replay(suite, task("b", fail_on="step"), row["messages"])
    assert broken.finish_reason == "error" and broken.infos == [
        {"error": "RuntimeError: step broke"}
    ]


class OpeningEngine(FakeEngine):
    """FakeEngine that honours a chat's opening: the turn is its ids, then the generated ones."""

    def __init__(self) -> None:
        super().__init__()
        self.openings: list[list[int]] = []

    def generate(self, chats, params):
        self.openings += [list(c.opening) for c in chats]
        gens = super().generate(chats, params)
        for chat, gen in zip(chats, gens, strict=True):
            if chat.opening:  # (the fake env reads the text: the opening adds no words)
                gen.token_ids = [*chat.opening, *gen.token_ids]
                gen.logprobs = [0.0] * len(chat.opening) + gen.logprobs
        return gens


def test_a_resumed_episode_goes_on_from_its_prefix_with_the_same_driver():
    suite, engine = FakeSuite(), OpeningEngine()
    (row,) = run_episodes(FakeEngine(), suite, [task("a")], sampling=SAMPLING, max_steps=1)
    assert row["finish_reason"] == "max_steps" and row["steps"] == 1
    ep = replay(suite, task("a"), row["messages"], row["turn_token_ids"], row["turn_logprobs"],
                keep_open=True, sample_idx=3)  # fmt: skip
    ep.opening = [97, 98]
    (same,) = drive(engine, suite, [ep], sampling=SAMPLING, max_steps=2)
    assert same is ep and engine.openings == [[97, 98]] and ep.opening == []
    assert ep.finish_reason == "done" and ep.success and ep.steps == 2 and ep.env is None
    assert ep.messages[:5] == row["messages"]
    assert ep.messages[5] == {"role": "assistant", "content": "<answer>49</answer>", "loss": True}
    assert ep.turn_token_ids == [[1, 2, 3], [97, 98, 2, 3, 4]]
    assert ep.turn_logprobs[1] == [0.0, 0.0, -0.5, -0.5, -0.5]
    assert ep.row("fake")["sample_idx"] == 3 and ep.row("fake")["tokens"] == 8

    # the same from an env restored by hand, and a server engine (one request per turn)
    env = suite.make()
    env.reset(task("a"))
    env.step(row["messages"][3]["content"])
    resumed = Episode.resume(task("a"), row["messages"], row["turn_token_ids"], env=env)
    resumed.steps = 1
    (each,) = drive(SubmittingEngine(), suite, [resumed], sampling=SAMPLING, max_steps=2)
    assert each.finish_reason == "done" and each.steps == 2 and env.closed
    assert each.messages[-1]["content"] == "<answer>49</answer>"
    with pytest.raises(ValueError, match="drive: an episode of a already finished \\(done\\)"):
        drive(FakeEngine(), suite, [each], sampling=SAMPLING, max_steps=2)
