"""Small pieces several stages share: reading tasks, shaping trajectory rows, and running
episodes shard by shard so a crash keeps the finished shards."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

import polars as pl

from flywheel.envs import EnvSuite, Task, row_to_task
from flywheel.store import ArtifactRef, ArtifactWriter, Store


def load_tasks(
    store: Store,
    tasks: ArtifactRef,
    *,
    env: str,
    split: str,
    limit: int | None = None,
    window: int = 0,
) -> list[Task]:
    """An env's tasks of one split; with ``limit``, the ``window``-th run of ``limit`` tasks
    (window 0 = the first ``limit``), wrapping around the end of the list."""
    frame = cast(pl.DataFrame, pl.from_arrow(store.read(tasks))).filter(
        (pl.col("env") == env) & (pl.col("split") == split)
    )
    if limit is not None and frame.height > 0:
        start = (window * limit) % frame.height
        frame = pl.concat([frame.slice(start), frame.slice(0, start)]).head(limit)
    return [row_to_task(r) for r in frame.iter_rows(named=True)]


def rollout_setup(
    cfg: Any,
    store: Store,
    policy: ArtifactRef,
    tasks: ArtifactRef,
    *,
    split: str,
    limit: int | None,
    window: int = 0,
) -> tuple[Any, dict[str, int], list[tuple[EnvSuite, list[Task]]]]:
    """What explore and evaluate both start from: an engine on the policy, each env's step
    limit, and each env's suite with its tasks of ``split`` (see ``load_tasks`` for ``window``)."""
    from flywheel.checkpoint import load_policy
    from flywheel.engines.hf import HFEngine
    from flywheel.envs import make_suite

    model, tokenizer = load_policy(store, policy)
    engine = HFEngine(model, tokenizer, batch_size=cfg.engine.batch_size)
    max_steps = {e.name: e.max_steps for e in cfg.envs}
    tasks_by_env = [
        (
            make_suite(e),
            load_tasks(store, tasks, env=e.name, split=split, limit=limit, window=window),
        )
        for e in cfg.envs
    ]
    return engine, max_steps, tasks_by_env


def trajectory_rows(
    episodes: list[dict[str, Any]], *, round: int, policy: str, source: str
) -> list[dict[str, Any]]:
    """Agent-loop episodes -> rows of the trajectories contract."""
    return [{**ep, "round": round, "policy": policy, "source": source} for ep in episodes]


def run_in_shards(
    writer: ArtifactWriter,
    tasks_by_env: list[tuple[EnvSuite, list[Task]]],
    *,
    shard_size: int,
    samples_per_task: int,
    rollout: Callable[[EnvSuite, list[Task], int], list[dict[str, Any]]],
    label: str,
) -> None:
    """Cut every env's tasks into shards of about ``shard_size`` episodes (a task's K samples
    stay in one shard), run the shards the writer does not have yet, write each as it ends.

    ``rollout(suite, tasks, shard_index)`` returns the shard's rows; the shard index seeds it, so
    a shard redone after a crash samples the same way."""
    tasks_per_shard = max(1, shard_size // samples_per_task)
    plan = []
    for suite, tasks in tasks_by_env:
        for start in range(0, len(tasks), tasks_per_shard):
            plan.append((suite, tasks[start : start + tasks_per_shard]))
    done = set(writer.finished_shards())
    if done:
        print(f"{label}: resuming, {len(done)}/{len(plan)} shards already written")
    for index, (suite, chunk) in enumerate(plan):
        if index in done:
            continue
        t0 = time.time()
        rows = rollout(suite, chunk, index)
        writer.write_shard(index, rows)
        ok = sum(r["success"] for r in rows) / max(len(rows), 1)
        print(
            f"{label}: shard {index + 1}/{len(plan)} {suite.name}: {len(rows)} episodes, "
            f"success {ok:.1%}, {time.time() - t0:.1f}s",
            flush=True,
        )
