"""benchmarks/eval_replay.py runs on a store's evaluation, prints both ways, and checks that the
infos as played and a replay give the same columns."""

from __future__ import annotations

import pytest

import stages.evaluate
import stages.expert
import stages.init
import stages.tasks
from benchmarks import eval_replay
from flywheel.config import dump_config, load_config
from flywheel.store import Store
from tests.conftest import tiny_overrides


@pytest.fixture
def evaluated(tmp_path):
    cfg = load_config(None, tiny_overrides(tmp_path))
    store = Store(cfg.run.store_root(), cfg.run.name)
    train, val, test = stages.tasks.run(cfg, store)
    init = stages.init.run(cfg, store, stages.expert.run(cfg, store, train, val), train)
    ev = stages.evaluate.run(cfg, store, init, test, round=0)
    path = tmp_path / "tiny.yaml"
    path.write_text(dump_config(cfg))
    args = ["--store", str(cfg.run.store_root()), "--run", cfg.run.name, "--config", str(path)]
    return args, ev


def test_tiny_run_prints_both_ways(evaluated, capsys):
    args, ev = evaluated
    eval_replay.main([*args, "--repeats", "1"])
    printed = capsys.readouterr().out
    assert f"{ev.id}: 8 episodes" in printed
    assert "infos as played" in printed and "replay every episode" in printed


def test_columns_that_differ_are_caught(evaluated, monkeypatch):
    args, _ = evaluated
    count_failed = stages.evaluate.count_failed
    calls = []

    def off_by_one_the_second_time(infos):
        calls.append(1)
        return count_failed(infos) + (len(calls) > 8)

    monkeypatch.setattr(stages.evaluate, "count_failed", off_by_one_the_second_time)
    with pytest.raises(AssertionError, match="columns differ"):
        eval_replay.main([*args, "--repeats", "1"])


def test_bad_input_is_one_line(evaluated, tmp_path, capsys):
    args, ev = evaluated
    init = next(i for i in ev.inputs if i.startswith("init-"))
    for extra, message in (
        (["--eval", "evaluate-000000000000"], "no artifact evaluate-000000000000"),
        (["--eval", init], rf"{init} is not an evaluation \(its stage: init\)"),
    ):
        with pytest.raises(SystemExit, match=message):
            eval_replay.main([*args, *extra])
    empty = ["--store", str(tmp_path / "empty"), *args[2:]]
    with pytest.raises(SystemExit, match="no round-0 evaluation"):
        eval_replay.main(empty)
    with pytest.raises(SystemExit):
        eval_replay.main([*args, "--repeats", "0"])
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err
