"""A round on the ``craft`` env through the real flow with ``iteration.data=[explore,reflect]``:
the bootstrap, then explore -> pareto -> reflect (the tiny policy continuing its own failed
trajectories from the craft hint, real envs) -> sft on the successes, the reflections and the
expert data -> evaluate. A second run is all cache hits."""

from __future__ import annotations

import pytest

from flywheel.config import load_config
from flywheel.store import Store
from tests.conftest import run_flywheel, stage_lines, tiny_overrides

CRAFT = (
    "{name: craft, n_train: 12, n_val: 4, n_test: 4, max_steps: 3, options: "
    "{depth_weights: [1, 0, 0, 0], min_distractors: 0, max_distractors: 0, max_count: 1}}"
)
OVERRIDES = (
    f"envs=[{CRAFT}]",
    "evaluate.untrained=false",
    "iteration.data=[explore,reflect]",
    "iteration.steps=[sft]",
    "sft.with_expert=true",  # the round trains even if nothing the tiny policy wrote succeeds
    "baselines=[]",
    "reflect.n_tasks=4",
    "reflect.max_evolve_times=2",
    "reflect.shard_size=4",
)


@pytest.mark.integration
def test_a_round_on_craft_with_reflection(tmp_path):
    overrides = tiny_overrides(tmp_path, *OVERRIDES)
    printed, _, _ = run_flywheel(overrides, rounds=1)
    round1 = [stage for r, stage, _, _ in stage_lines(printed) if r == 1]
    assert round1 == ["explore", "pareto", "pareto", "reflect", "sft", "evaluate"], printed[-3000:]

    cfg = load_config(None, overrides)
    store = Store(cfg.run.store_root(), cfg.run.name)
    (explored,) = store.list(1, "explore")
    (reflected,) = store.list(1, "reflect")
    (sft0,) = store.list(0, "sft")
    (sft1,) = store.list(1, "sft")
    assert reflected.inputs == [explored.id, sft0.id, explored.inputs[1]]
    # every failed trajectory of the first 4 tasks with one, 1 or 2 attempts each
    rows = store.read(explored, columns=["task_id", "success", "finish_reason"]).to_pylist()
    failed = [r for r in rows if not r["success"] and r["finish_reason"] != "error"]
    first = list(dict.fromkeys(r["task_id"] for r in failed))[:4]
    n = sum(r["task_id"] in first for r in failed)
    s = reflected.summary
    assert s["craft/reflected"] == n > 0 and s["craft/skipped"] == 0, s
    assert n <= s["craft/attempts"] <= 2 * n
    assert s["craft/attempts"] == 2 * n - s["craft/successes"]  # only a success stops early
    assert s["craft/recovered_share"] == s["craft/successes"] / n
    kept = store.read(reflected, columns=["source", "success"]).to_pylist()
    assert len(kept) == s["craft/successes"] and all(r["success"] for r in kept)
    assert all(r["source"] == "revision" for r in kept)
    # round sft trains on the explored successes, the reflections and the expert data
    assert sft1.inputs[:3] == [sft0.id, explored.id, reflected.id]

    again, _, _ = run_flywheel(overrides, rounds=1)
    assert all(hit for _, _, hit, _ in stage_lines(again)), again[-3000:]
