"""The arith suite: deterministic disjoint splits, in-range numbers, a perfect expert, a strict env."""

from __future__ import annotations

import operator
import re

import pytest

from flywheel.envs import arith
from flywheel.envs.arith import ArithEnv, ArithSuite, answer_matches, parse_action, split_of
from flywheel.envs.base import Env, EnvSuite, Task
from flywheel.envs.sandbox import SandboxResult

_EXPR = re.compile(r"print\((\d+) (\+|-|\*|//) (\d+)\)")
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv}


def _fake_python(code: str, **_limits: object) -> SandboxResult:
    """Evaluates the expert's one-line calls in-process: hundreds of episodes in milliseconds."""
    match = _EXPR.fullmatch(code)
    assert match, code
    a, op, b = match.groups()
    return SandboxResult("ok", f"{_OPS[op](int(a), int(b))}\n")


def _play(suite: ArithSuite, task: Task) -> tuple[float, list[str]]:
    env = suite.make()
    observations = [env.reset(task)]
    reward, done = 0.0, False
    for turn in suite.expert(task):
        obs, reward, done, info = env.step(turn)
        observations.append(obs)
        assert not info["invalid"] and not info["tool_error"]
    env.close()
    assert done
    return reward, observations


def test_max_value_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="max_value"):
        ArithSuite(max_value=10)


def test_implements_the_protocol() -> None:
    suite = ArithSuite()
    assert isinstance(suite, EnvSuite)
    assert isinstance(suite.make(), Env)
    assert suite.name == "arith"
    assert "<python>" in suite.instruction and "<answer>" in suite.instruction


def test_tasks_are_deterministic_and_prefix_stable() -> None:
    suite = ArithSuite()
    first = suite.tasks("train", 30, seed=7)
    assert first == suite.tasks("train", 30, seed=7)
    assert first[:10] == suite.tasks("train", 10, seed=7)
    assert [t.prompt for t in first] != [t.prompt for t in suite.tasks("train", 30, seed=8)]
    assert first[3].task_id == "arith-train-000003"
    assert all(t.env == "arith" and t.split == "train" and t.seed == 7 for t in first)


def test_splits_never_share_a_prompt() -> None:
    suite = ArithSuite(difficulty_weights=(1, 0, 0))  # the smallest prompt space
    train = {t.prompt for t in suite.tasks("train", 1500, seed=0)}
    test = {t.prompt for t in suite.tasks("test", 500, seed=0)}
    assert len(train) == 1500 and len(test) == 500  # no duplicates within a split either
    assert not train & test
    assert {split_of(p) for p in train} == {"train"}
    assert {split_of(p) for p in test} == {"test"}
    with pytest.raises(ValueError):
        suite.tasks("dev", 1, seed=0)


@pytest.mark.parametrize("max_value", [999, 99])
def test_numbers_are_integers_in_range_and_steps_chain(max_value: int) -> None:
    tasks = ArithSuite(max_value=max_value).tasks("train", 600, seed=1)
    for task in tasks:
        assert all(0 <= int(n) <= max_value for n in re.findall(r"\d+", task.prompt)), task.prompt
        steps = task.meta["steps"]
        assert len(steps) == task.difficulty
        for prev, step in zip([None, *steps], steps, strict=False):
            if prev is not None:
                assert step["a"] == prev["result"]
            assert all(0 <= step[k] <= max_value for k in ("a", "b", "result"))
        assert str(steps[0]["a"]) in task.prompt
        assert all(str(step["b"]) in task.prompt for step in steps)
        assert task.answer == str(steps[-1]["result"])


def test_vocabulary_is_modest_and_difficulties_follow_the_weights() -> None:
    tasks = ArithSuite().tasks("train", 900, seed=2)
    words = {w for t in tasks for w in re.findall(r"[A-Za-z']+", t.prompt)}
    assert 80 < len(words) < 400
    counts = [sum(t.difficulty == d for t in tasks) for d in (1, 2, 3)]
    assert all(250 < c < 350 for c in counts), counts
    only_hard = ArithSuite(difficulty_weights=(0, 0, 1)).tasks("test", 50, seed=0)
    assert {t.difficulty for t in only_hard} == {3}
    ops = {s["op"] for t in tasks for s in t.meta["steps"]}
    assert ops == {"+", "-", "*", "/"}


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_expert_solves_every_task(difficulty: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arith, "run_python", _fake_python)
    weights = [0.0, 0.0, 0.0]
    weights[difficulty - 1] = 1.0
    suite = ArithSuite(difficulty_weights=weights)
    for split in ("train", "test"):
        for task in suite.tasks(split, 200, seed=3):
            reward, _ = _play(suite, task)
            assert reward == 1.0, task


def test_expert_solves_tasks_with_the_real_sandbox() -> None:
    suite = ArithSuite(difficulty_weights=(0, 0, 1))
    task = suite.tasks("test", 1, seed=0)[0]
    reward, observations = _play(suite, task)
    assert reward == 1.0
    steps = task.meta["steps"]
    assert observations[1:-1] == [str(s["result"]) for s in steps]
    assert observations[-1] == "Done."


def _env() -> tuple[ArithEnv, Task]:
    env = ArithEnv()
    task = Task("arith-test-000000", "arith", "test", 0, 1, "Sam has 37 apples.", "147")
    env.reset(task)
    return env, task


def test_python_actions_report_tool_outcomes() -> None:
    env, _ = _env()
    obs, reward, done, info = env.step("I add. <python>print(37 + 12)</python>")
    assert (obs, reward, done) == ("49", 0.0, False)
    assert info == {
        "tool_call": True,
        "tool_error": False,
        "tool_ok": True,
        "invalid": False,
        "success": False,
    }
    obs, _, done, info = env.step("<python>print(1 // 0)</python>")
    assert obs == "Error: ZeroDivisionError: integer division or modulo by zero"
    assert info["tool_error"] and not info["tool_ok"] and not done
    obs, _, _, info = env.step("<python>x = 3</python>")
    assert obs == "(no output)"
    assert info["tool_call"] and not info["tool_ok"] and not info["tool_error"]


def test_invalid_actions_do_not_end_the_episode() -> None:
    env, _ = _env()
    for action in ("the answer is 147", "<python></python>", "print(1)"):
        obs, reward, done, info = env.step(action)
        assert obs.startswith("Invalid action.")
        assert (reward, done, info["invalid"], info["tool_call"]) == (0.0, False, True, False)


@pytest.mark.parametrize("text", ["147", " 147 ", "147.0", "+147", "\n147\n"])
def test_right_answers_in_any_numeric_form(text: str) -> None:
    env, _ = _env()
    obs, reward, done, info = env.step(f"<answer>{text}</answer>")
    assert (reward, done, info["success"]) == (1.0, True, True)
    with pytest.raises(RuntimeError):
        env.step("<answer>147</answer>")


@pytest.mark.parametrize("text", ["148", "147.5", "one hundred", "147 apples", "1,47"])
def test_wrong_answers_end_with_zero(text: str) -> None:
    env, _ = _env()
    _, reward, done, info = env.step(f"<answer>{text}</answer>")
    assert (reward, done, info["success"]) == (0.0, True, False)


def test_the_last_tag_wins_and_a_trailing_open_tag_counts() -> None:
    assert parse_action("<python>print(1)</python> <answer>5</answer>") == ("answer", "5")
    assert parse_action("<answer>5</answer> <python>print(1)</python>") == ("python", "print(1)")
    assert parse_action("<python>print(2)</python> <python>print(3)") == ("python", "print(3)")
    assert parse_action("nothing here") is None
    assert answer_matches("147.0", "147") and not answer_matches("", "147")


def test_step_before_reset_and_snapshot_restore() -> None:
    with pytest.raises(RuntimeError):
        ArithEnv().step("<answer>1</answer>")
    env, task = _env()
    state = env.snapshot()
    env.step("<answer>1</answer>")
    env.restore(state)
    _, reward, done, _ = env.step("<answer>147</answer>")
    assert (reward, done) == (1.0, True)
