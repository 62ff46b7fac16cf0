"""The Prefect flows in-process on the tiny config: the first ``flywheel_flow`` runs every stage,
a second one is all cache hits and fast, a changed stage config reruns that stage and what
follows only, ``stage_flow(..., force=True)`` writes one new version and stops, and
``flywheel report --json`` reads the evaluations back."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from flows.flywheel import stage_flow
from flywheel.cli import main
from flywheel.config import load_config
from flywheel.store import Store
from tests.conftest import run_flywheel, stage_lines, tiny_overrides, write_tiny_yaml

BOOTSTRAP = ["tasks", "expert", "init", "evaluate", "sft", "evaluate"]

pytestmark = pytest.mark.slow


def manifests(root: Path) -> set[str]:
    return {str(p.parent.relative_to(root)) for p in (root / "store").rglob("manifest.json")}


def test_first_run_runs_every_stage(tiny_flywheel):
    lines = tiny_flywheel.lines
    assert [stage for r, stage, _, _ in lines if r == 0] == BOOTSTRAP
    round1 = [stage for r, stage, _, _ in lines if r == 1]
    assert round1[0] == "explore" and round1[-1] == "evaluate"
    cfg = load_config(None, tiny_flywheel.overrides)
    steps = cfg.iteration.steps
    assert set(steps) <= set(round1), f"round 1 ran {round1}, configured steps {steps}"
    assert {r for r, *_ in lines} == {0, 1}
    assert not [line for line in lines if line[2]], "a stage was a cache hit on the first run"
    # every artifact in the store was announced, and every announced one is in the store
    assert tiny_flywheel.artifacts == {art_id for *_, art_id in lines}
    assert len({art_id for *_, art_id in lines}) == len(lines)


def test_second_run_is_all_cache_hits_and_fast(tiny_flywheel):
    before = manifests(tiny_flywheel.root)
    printed, seconds, rows = run_flywheel(tiny_flywheel.overrides, rounds=1)
    lines = stage_lines(printed)
    assert [(r, s, a) for r, s, _, a in lines] == [(r, s, a) for r, s, _, a in tiny_flywheel.lines]
    assert all(hit for _, _, hit, _ in lines), printed
    assert manifests(tiny_flywheel.root) == before
    assert seconds < tiny_flywheel.seconds / 2, (seconds, tiny_flywheel.seconds)
    assert rows == tiny_flywheel.report


@pytest.mark.parametrize(
    ("override", "first_rerun"),
    [("evaluate.temperature=0.5", None), ("sft.lr=0.001", "sft"), ("dpo.beta=[0.2]", "dpo")],
    ids=["evaluate", "sft", "dpo-beta"],
)
def test_changed_config_reruns_that_stage_and_what_follows(tiny_flywheel, override, first_rerun):
    before = manifests(tiny_flywheel.root)
    printed, _, _ = run_flywheel([*tiny_flywheel.overrides, override], rounds=1)
    lines = stage_lines(printed)
    assert [(r, s) for r, s, _, _ in lines] == [(r, s) for r, s, _, _ in tiny_flywheel.lines]
    if first_rerun is None:  # evaluate's config feeds no other stage
        reran = {s for _, s, hit, _ in lines if not hit}
        assert reran == {"evaluate"}, printed
        assert all(not hit for _, s, hit, _ in lines if s == "evaluate")
    else:
        cut = next(i for i, (_, s, _, _) in enumerate(lines) if s == first_rerun)
        assert all(hit for _, _, hit, _ in lines[:cut]), printed
        assert not any(hit for _, _, hit, _ in lines[cut:]), printed
    old = {art_id for *_, art_id in tiny_flywheel.lines}
    new = {art_id for _, _, hit, art_id in lines if not hit}
    assert not new & old
    assert manifests(tiny_flywheel.root) - before == {
        m for m in manifests(tiny_flywheel.root) if m.rsplit("/", 1)[-1] in new
    }


def test_stage_flow_force_writes_one_new_version_and_stops(tiny_flywheel, tmp_path):
    # a copy of the store: the new sft version would make later runs redo what follows it
    shutil.copytree(tiny_flywheel.root / "store", tmp_path / "store")
    overrides = tiny_overrides(tmp_path)
    before = manifests(tmp_path)
    sft_id = next(a for r, s, _, a in tiny_flywheel.lines if (r, s) == (0, "sft"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        new_id = stage_flow("sft", round=0, overrides=overrides, force=True)
    assert new_id == sft_id + ".2"
    lines = stage_lines(out.getvalue())
    assert [s for _, s, _, _ in lines] == ["tasks", "expert", "init", "evaluate", "sft"]
    assert all(hit for _, s, hit, _ in lines if s != "sft")
    assert lines[-1][2:] == (False, new_id)
    assert manifests(tmp_path) - before == {f"store/tiny/round-0/sft/{new_id}"}
    store = Store(str(tmp_path / "store"), "tiny")
    assert store.latest("sft", round=0).id == new_id
    assert store.get(new_id).inputs == store.get(sft_id).inputs


def test_report_json(tiny_flywheel, capsys):
    path = write_tiny_yaml(tiny_flywheel.root)
    run_flywheel(tiny_flywheel.overrides, rounds=1)  # the report reads the last run's evaluations
    capsys.readouterr()
    assert main(["report", "--json", "--config", str(path)]) == 0
    out, err = capsys.readouterr()
    rows = json.loads(out)
    assert isinstance(rows, list) and rows
    evaluations = [a for r, s, _, a in tiny_flywheel.lines if s == "evaluate"]
    assert [row["eval_id"] for row in rows] == evaluations
    assert [(row["round"], row["policy"]) for row in rows][:2] == [(0, "init"), (0, "sft")]
    assert [row["round"] for row in rows] == [0, 0, 1]
    store = Store(str(tiny_flywheel.root / "store"), "tiny")
    for row in rows:
        assert row["env"] == "arith"
        assert row["n_tasks"] == 8 and isinstance(row["n_tasks"], int)
        summary = store.get(row["eval_id"]).summary
        assert row["success_rate"] == summary["arith/success_rate"]
        assert row["avg_reward"] == summary["arith/avg_reward"]
        assert row["checkpoint"] == store.get(row["eval_id"]).manifest["policy"]
        assert row["policy"] == store.get(row["checkpoint"]).stage
    # the table form shows the same policies
    assert main(["report", "--config", str(path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:4] == ["round", "policy", "env", "success_rate"]
    assert len(table) == 2 + len(rows)
