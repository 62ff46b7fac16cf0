"""Stage ``tasks``: generate the train and test tasks of every configured env (round 0).

Run it alone with:

    flywheel stage tasks --round 0
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from flywheel.config import Config
from flywheel.envs import make_suite, task_to_row
from flywheel.store import ArtifactRef, Store


def run(cfg: Config, store: Store, *, force: bool = False) -> ArtifactRef:
    w = store.writer(
        "tasks", stage="tasks", round=0, config=cfg.stage_inputs("tasks"), inputs=[], force=force
    )
    if w.cached:
        return w.ref
    rows: list[dict[str, Any]] = []
    for env_cfg in cfg.envs:
        suite = make_suite(env_cfg)
        for split, n in (("train", env_cfg.n_train), ("test", env_cfg.n_test)):
            tasks = suite.tasks(split, n, cfg.run.seed)
            rows.extend(task_to_row(t) for t in tasks)
    ids = [r["task_id"] for r in rows]
    if len(set(ids)) != len(ids):
        raise ValueError("tasks: two tasks share a task_id; env names must make ids unique")
    w.write_shard(0, rows)
    counts = Counter(f"{r['env']}/{r['split']}" for r in rows)
    return w.commit(summary={f"{k}_tasks": v for k, v in sorted(counts.items())})
