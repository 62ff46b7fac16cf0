"""``sft.restarts``: the bootstrap trained several times with data orders seed, seed + 1, ...,
keeping the run with the best validation score; what it hashes; a crash between runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import stages.expert
import stages.init
import stages.sft
import stages.tasks
from flywheel.checkpoint import checkpoint_dir, load_policy, weights_digest
from flywheel.config import ConfigError, load_config
from flywheel.store import Store
from flywheel.training.launch import run_training
from stages._common import start_validation, validation
from tests.conftest import tiny_overrides

RESTARTS = ["sft.val_every=1", "sft.val_metric=loss", "sft.patience=10", "sft.max_steps=4"]


def _bootstrap_inputs(tmp_path, *extra):
    cfg = load_config(None, tiny_overrides(tmp_path, *RESTARTS, *extra))
    store = Store(cfg.run.store_root(), cfg.run.name)
    train, val, _ = stages.tasks.run(cfg, store)
    expert = stages.expert.run(cfg, store, train, val)
    init = stages.init.run(cfg, store, expert, train)
    return cfg, store, init, expert


def _sft(cfg, store, init, expert):
    return stages.sft.run(cfg, store, init, [expert], round=0, val_demos=expert)


def test_restarts_keep_the_run_with_the_best_val_score(tmp_path):
    cfg, store, init, expert = _bootstrap_inputs(tmp_path, "sft.restarts=3")
    ref = _sft(cfg, store, init, expert)
    runs = ref.summary["restarts"]
    assert [r["seed"] for r in runs] == [0, 1, 2]
    scores = [r["best_score"] for r in runs]
    assert len(set(scores)) == 3  # three data orders, three val curves
    kept = [r for r in runs if r["kept"]]
    assert len(kept) == 1 and kept[0]["best_score"] == max(scores)
    assert ref.summary["best_step"] == kept[0]["best_step"]

    # The kept weights are those of one plain run with that data order from the same init.
    model, tokenizer = load_policy(store, init)
    sc = stages.sft.section(cfg, 0)
    _, known = start_validation(cfg, sc, store, init, None, expert)
    examples = stages.sft.examples_from(store, [expert], tokenizer)
    plain = tmp_path / "plain"
    run_training(
        model, examples, model_dir=checkpoint_dir(store, init), loss="sft", cfg=sc,
        seed=kept[0]["seed"], out_dir=plain, start_validation=known,
        validation=lambda: validation(cfg, sc, store, tokenizer, None, expert),
    )  # fmt: skip
    folder = checkpoint_dir(store, ref)
    assert weights_digest(folder) == weights_digest(plain)

    # Only each run's result stays in its folder: no weights, no train state.
    for k in range(3):
        left = sorted(p.name for p in (folder / f"restart-{k}").iterdir())
        assert left == ["result.json"]
        result = json.loads((folder / f"restart-{k}" / "result.json").read_text())
        assert result["best_score"] == runs[k]["best_score"] and result["steps"] == 3  # 1 epoch


def test_a_crash_between_restarts_keeps_the_finished_runs(tmp_path, monkeypatch):
    cfg, store, init, expert = _bootstrap_inputs(tmp_path, "sft.restarts=3")
    seeds: list[int] = []

    def crash_on_third(*args, **kw):
        seeds.append(kw["seed"])
        if len(seeds) == 3:
            raise KeyboardInterrupt("killed during the third run")
        return run_training(*args, **kw)

    monkeypatch.setattr(stages.sft, "run_training", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        _sft(cfg, store, init, expert)
    assert seeds == [0, 1, 2]

    def counted(*args, **kw):
        seeds.append(kw["seed"])
        return run_training(*args, **kw)

    seeds.clear()
    monkeypatch.setattr(stages.sft, "run_training", counted)
    resumed = _sft(cfg, store, init, expert)
    assert seeds == [2]  # the two finished runs were not trained again

    # The same artifact, weights and choice as a run that was never interrupted.
    cfg2, store2, init2, expert2 = _bootstrap_inputs(tmp_path / "again", "sft.restarts=3")
    whole = _sft(cfg2, store2, init2, expert2)
    assert resumed.id == whole.id

    def untimed(ref):
        return [
            {k: v for k, v in r.items() if k != "train_time_s"} for r in ref.summary["restarts"]
        ]

    assert untimed(resumed) == untimed(whole)
    assert weights_digest(checkpoint_dir(store, resumed)) == weights_digest(
        checkpoint_dir(store2, whole)
    )


def test_a_crash_while_the_kept_weights_move_is_finished_by_a_rerun(tmp_path, monkeypatch):
    cfg, store, init, expert = _bootstrap_inputs(tmp_path, "sft.restarts=2")
    real_replace = stages.sft.os.replace
    moved: list[str] = []

    def crash_on_second_move(src, dst):
        src, dst = Path(src), Path(dst)
        # Only the moves from a run's folder up into the artifact's (training saves files
        # with os.replace too, inside the run's folder).
        if src.parent.name.startswith("restart-") and dst.parent == src.parent.parent:
            moved.append(src.name)
            if len(moved) == 2:
                raise KeyboardInterrupt("killed while moving the kept run's files")
        return real_replace(src, dst)

    monkeypatch.setattr(stages.sft.os, "replace", crash_on_second_move)
    with pytest.raises(KeyboardInterrupt):
        _sft(cfg, store, init, expert)
    assert len(moved) == 2  # one file moved, the crash on the next
    monkeypatch.setattr(stages.sft.os, "replace", real_replace)

    trained: list[int] = []

    def counted(*args, **kw):
        trained.append(kw["seed"])
        return run_training(*args, **kw)

    monkeypatch.setattr(stages.sft, "run_training", counted)
    resumed = _sft(cfg, store, init, expert)
    assert trained == []  # both runs had finished: the rerun only moves what was left

    cfg2, store2, init2, expert2 = _bootstrap_inputs(tmp_path / "again", "sft.restarts=2")
    whole = _sft(cfg2, store2, init2, expert2)
    assert resumed.id == whole.id
    assert weights_digest(checkpoint_dir(store, resumed)) == weights_digest(
        checkpoint_dir(store2, whole)
    )
    folder = checkpoint_dir(store, resumed)
    for k in range(2):
        assert sorted(p.name for p in (folder / f"restart-{k}").iterdir()) == ["result.json"]


def test_restarts_are_hashed_only_when_above_one_and_only_in_round_0(tmp_path):
    one = load_config(None, tiny_overrides(tmp_path, *RESTARTS))
    three = load_config(None, tiny_overrides(tmp_path, *RESTARTS, "sft.restarts=3"))
    assert "restarts" not in stages.sft.artifact_config(one, 0)["sft"]
    assert stages.sft.artifact_config(three, 0)["sft"]["restarts"] == 3
    # A round's SFT step does not restart: its id is the same either way.
    assert stages.sft.artifact_config(one, 1) == stages.sft.artifact_config(three, 1)
    # Nor is it in a run's train-state fingerprint (each run has its own folder and seed).
    assert "restarts" not in three.sft.result_dump()


def test_restarts_without_validation_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"restarts \(2\) keeps the run with the best validation"):
        load_config(None, tiny_overrides(tmp_path, "sft.restarts=2", "sft.val_every=0"))


def test_restart_until_stops_at_the_first_run_that_reaches_it(tmp_path):
    cfg, store, init, expert = _bootstrap_inputs(tmp_path / "all", "sft.restarts=3")
    scores = [r["best_score"] for r in _sft(cfg, store, init, expert).summary["restarts"]]

    def runs_with(until: float, name: str) -> list[dict]:
        cfg, store, init, expert = _bootstrap_inputs(
            tmp_path / name, "sft.restarts=3", f"sft.restart_until={until!r}"
        )
        return _sft(cfg, store, init, expert).summary["restarts"]

    # The first run reaches its own score: no further run starts, and it is kept.
    first = runs_with(scores[0], "first")
    assert [(r["seed"], r["best_score"], r["kept"]) for r in first] == [(0, scores[0], True)]
    # A score no run reaches: all three, as without restart_until.
    assert [r["best_score"] for r in runs_with(1e9, "never")] == scores
    # Just above the first run's score: the runs stop at the first that reaches it.
    until = scores[0] + 1e-9
    made = next((k + 1 for k, s in enumerate(scores) if s >= until), 3)
    some = runs_with(until, "some")
    assert [r["seed"] for r in some] == list(range(made))
    assert [r["kept"] for r in some].index(True) == max(range(made), key=lambda k: scores[k])


def test_restart_until_is_hashed_only_when_set_with_restarts(tmp_path):
    three = load_config(None, tiny_overrides(tmp_path, *RESTARTS, "sft.restarts=3"))
    until = load_config(
        None, tiny_overrides(tmp_path, *RESTARTS, "sft.restarts=3", "sft.restart_until=-0.25")
    )
    assert "restart_until" not in stages.sft.artifact_config(three, 0)["sft"]
    assert stages.sft.artifact_config(until, 0)["sft"]["restart_until"] == -0.25
    assert stages.sft.artifact_config(three, 1) == stages.sft.artifact_config(until, 1)
    assert "restart_until" not in until.sft.result_dump()
    # One run has nothing to stop: the setting changes nothing, id included.
    one = load_config(None, tiny_overrides(tmp_path, *RESTARTS))
    one_until = load_config(None, tiny_overrides(tmp_path, *RESTARTS, "sft.restart_until=-0.25"))
    assert stages.sft.artifact_config(one, 0) == stages.sft.artifact_config(one_until, 0)
