"""flywheel/coverage.py: tasks grouped by the rarest token of the oracle's solution on hand-made
counts, ``flywheel coverage`` on the shared tiny flywheel's explore artifact, and ``flywheel
compare`` (flywheel/report.py) on its evaluations."""

from __future__ import annotations

import pytest

from flywheel.cli import main
from flywheel.coverage import BUCKETS, bucket_of, group_tasks, rarest, token_counts
from flywheel.report import paired_standard_error


def test_buckets_cover_every_count_once():
    assert [bucket_of(n) for n in (0, 1, 2, 3, 5, 6, 1000)] == [
        "never", "1-2 times", "1-2 times", "3-5 times", "3-5 times", "6+ times", "6+ times",
    ]  # fmt: skip
    assert [label for label, _, _ in BUCKETS] == ["never", "1-2 times", "3-5 times", "6+ times"]
    with pytest.raises(ValueError, match="never negative"):
        bucket_of(-1)


def test_tasks_are_grouped_by_their_solutions_rarest_token():
    # the demonstrations write token 1 eight times, 2 four times, 3 once, 9 never
    counts = token_counts([[1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 2, 2, 3]])
    assert counts == {1: 8, 2: 4, 3: 1}
    assert rarest([1, 2], counts) == 4 and rarest([1, 9], counts) == 0 and rarest([], counts) == 8
    solutions = {"a": [1, 1], "b": [1, 2], "c": [2, 3], "d": [9, 1], "e": [1, 9], "f": [1]}
    solved = {"a": True, "b": False, "c": True, "d": False, "e": True, "f": True}
    groups = group_tasks(solutions, solved, counts)
    got = {label: (g.tasks, g.solved, g.unsolved) for label, g in groups.items()}
    assert got == {
        "never": (2, 1, 1),  # d, e
        "1-2 times": (1, 1, 0),  # c
        "3-5 times": (1, 0, 1),  # b
        "6+ times": (2, 2, 0),  # a, f
    }


@pytest.fixture(scope="module")
def tiny(tiny_cli):
    return tiny_cli


@pytest.mark.slow  # the shared tiny flywheel run
def test_coverage_reads_a_real_explore_artifact(tiny, capsys):
    path, store, made = tiny
    # the run's own artifacts: other tests of the session add versions to the shared store
    (explore,) = [r for r in store.list(round=1, stage="explore") if r.id in made]
    (expert,) = [r for r in store.list(round=0, stage="expert") if r.id in made]
    capsys.readouterr()
    assert main(["coverage", "--config", str(path), explore.id]) == 0
    out = capsys.readouterr().out
    rows = store.read(explore).to_pylist()
    tasks = {r["task_id"] for r in rows}
    solved = {r["task_id"] for r in rows if r["success"]}
    assert f"{explore.id}: {len(rows)} samples from {explore.inputs[0]}" in out
    assert f"demonstrations: {expert.id} (" in out
    (total,) = [line for line in out.splitlines() if line.strip().startswith("all ")]
    assert total.split()[1:] == [str(len(tasks)), f"{len(solved) / len(tasks):.1%}",
                                 str(len(tasks) - len(solved))]  # fmt: skip


@pytest.mark.slow  # the shared tiny flywheel run
def test_coverage_refuses_an_artifact_that_is_not_an_exploration(tiny, capsys):
    path, store, made = tiny
    (sft,) = [r for r in store.list(round=0, stage="sft") if r.id in made]
    capsys.readouterr()
    assert main(["coverage", "--config", str(path), sft.id]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"flywheel: error: {sft.id} is a sft artifact; coverage reads an explore artifact"


@pytest.mark.slow  # the shared tiny flywheel run
def test_compare_gives_the_paired_gain_of_two_evaluations(tiny, capsys):
    """``flywheel compare`` on the tiny run's evaluations of round 1 and of the SFT policy."""
    path, store, made = tiny
    (r0,) = [r for r in store.list(round=0, stage="evaluate") if r.id in made and
             r.inputs[0].startswith("sft-")]  # fmt: skip
    (r1,) = [r for r in store.list(round=1, stage="evaluate") if r.id in made and
             not r.inputs[0].startswith(("sft_more-", "rft-"))]  # fmt: skip
    capsys.readouterr()
    assert main(["compare", "--config", str(path), r1.id, r0.id]) == 0
    out = capsys.readouterr().out
    a = {(x["env"], x["task_id"]): float(x["success"]) for x in store.read(r1).to_pylist()}
    b = {(x["env"], x["task_id"]): float(x["success"]) for x in store.read(r0).to_pylist()}
    keys = sorted(a)
    xa, xb = [a[k] for k in keys], [b[k] for k in keys]
    gain = 100 * (sum(xa) - sum(xb)) / len(keys)
    se = 100 * paired_standard_error(xa, xb)
    assert f"{r1.id} (A) against {r0.id} (B)" in out
    assert f"arith        {len(keys)} tasks" in out
    assert f"A {100 * r1.summary['arith/success_rate']:5.1f}%" in out
    assert f"A - B {gain:+5.1f} ± {se:.1f}" in out
    # Against several evaluations (a baseline's repeats): their mean, task by task.
    assert main(["compare", r1.id, r0.id, r1.id, "--config", str(path)]) == 0
    out = capsys.readouterr().out
    mean = [(x + y) / 2 for x, y in zip(xa, xb, strict=True)]
    half = 100 * (sum(xa) - sum(mean)) / len(keys)
    assert f"against the mean of {r0.id}, {r1.id} (B)" in out
    assert f"A - B {half:+5.1f} ± {100 * paired_standard_error(xa, mean):.1f}" in out
    assert f"(each {100 * sum(xb) / len(keys):.1f}%, {100 * sum(xa) / len(keys):.1f}%)" in out
    assert main(["compare", "--config", str(path), r1.id, "run.seed=0"]) == 2
    assert "needs at least one eval artifact after the first" in capsys.readouterr().err
    assert main(["compare", "--config", str(path), r1.id, r1.inputs[0]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("is a checkpoints artifact; compare reads eval artifacts")
