"""Stage ``tasks``: generate the train, val and test tasks of every configured env (round 0).

One artifact per split, so lineage shows which split every later artifact was made from: the
training and selection stages read ``train`` and ``val``, and only ``evaluate`` reads ``test``
(tests/flows check that no checkpoint's lineage holds a test-split artifact).

    flywheel stage tasks --round 0
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from flywheel.config import Config
from flywheel.envs import make_suite, task_to_row
from flywheel.store import ArtifactRef, Store

SPLITS = ("train", "val", "test")


def artifact_config(cfg: Config, split: str) -> dict[str, Any]:
    """What a split's artifact id hashes: every env's settings and its task count for this
    split, the seed and the split (more val tasks leave the train and test artifacts as they are)."""
    counts = [getattr(e, f"n_{split}") for e in cfg.envs]
    return {"envs": cfg.envs_dump(), "counts": counts, "seed": cfg.run.seed, "split": split}


def run(cfg: Config, store: Store, *, force: bool = False) -> tuple[ArtifactRef, ...]:
    """The (train, val, test) task artifacts."""
    writers = [
        store.writer(
            "tasks",
            stage="tasks",
            round=0,
            config=artifact_config(cfg, split),
            inputs=[],
            force=force,
        )
        for split in SPLITS
    ]
    if all(w.cached for w in writers):
        return tuple(w.ref for w in writers)
    suites = [(env_cfg, make_suite(env_cfg)) for env_cfg in cfg.envs]
    seen: set[str] = set()
    for split, w in zip(SPLITS, writers, strict=True):
        rows: list[dict[str, Any]] = []
        for env_cfg, suite in suites:
            n = getattr(env_cfg, f"n_{split}")
            if n:
                rows.extend(task_to_row(t) for t in suite.tasks(split, n, cfg.run.seed))
        ids = [r["task_id"] for r in rows]
        if len(set(ids)) != len(ids) or seen & set(ids):
            raise ValueError("tasks: two tasks share a task_id; env names must make ids unique")
        seen |= set(ids)
        if w.cached:
            continue
        w.write_shard(0, rows)
        counts = Counter(f"{r['env']}/{split}" for r in rows)
        w.commit(
            summary={f"{k}_tasks": v for k, v in sorted(counts.items())}, extra={"split": split}
        )
    return tuple(w.ref for w in writers)
