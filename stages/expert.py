"""Stage ``expert``: trajectories of every env's oracle (source=expert) on the training tasks
that get demonstrations and on every val task.

Demonstrations are expensive where they come from people; tasks with only a reward check are
cheap. ``expert.n_tasks: N`` gives demonstrations for N train tasks of each env, spread evenly
over the split (every (n_train / N)-th task), so every window of tasks a round explores holds
the same share of demonstrated tasks; exploration covers the rest from rewards alone. The val split's oracle runs are what SFT's
validation loss is measured on (``sft.val_metric: loss``); no stage trains on them.

Each oracle turn is stepped through a real env, so the stored observations and rewards are what
the env really returns; an oracle that fails a task is reported in the summary.

    flywheel stage expert --round 0
"""

from __future__ import annotations

from typing import Any, cast

import polars as pl

from flywheel.agent import expert_episodes
from flywheel.config import Config
from flywheel.envs import make_suite
from flywheel.progress import Progress
from flywheel.store import ArtifactRef, Store
from stages._common import load_tasks, trajectory_rows


def artifact_config(cfg: Config) -> dict[str, Any]:
    """What the artifact id hashes: every env's settings and the share with demonstrations."""
    return {"envs": cfg.envs_dump(), "n_tasks": cfg.expert.n_tasks}


def spread(tasks: list[Any], n: int | None) -> list[Any]:
    """``n`` of ``tasks`` evenly spaced (index i * len / n), in order; all of them for None."""
    if n is None or n >= len(tasks):
        return tasks
    return [tasks[i * len(tasks) // n] for i in range(n)]


def run(
    cfg: Config, store: Store, train: ArtifactRef, val: ArtifactRef, *, force: bool = False
) -> ArtifactRef:
    w = store.writer(
        "trajectories",
        stage="expert",
        round=0,
        config=artifact_config(cfg),
        inputs=[train.id, val.id],
        force=force,
    )
    if w.cached:
        return w.ref
    shard = 0
    for env_cfg in cfg.envs:
        suite = make_suite(env_cfg)
        for split, ref in (("train", train), ("val", val)):
            if not w.has_shard(shard):
                env_tasks = load_tasks(store, ref, env=env_cfg.name, split=split)
                if split == "train":
                    env_tasks = spread(env_tasks, cfg.expert.n_tasks)
                label = f"expert: {env_cfg.name} {split}:"
                with Progress(label, len(env_tasks), unit="episodes") as bar:
                    episodes = expert_episodes(
                        suite, env_tasks, progress=lambda n, _: bar.update(n - bar.done)
                    )
                    rows = trajectory_rows(episodes, round=0, policy="oracle", source="expert")
                    w.write_shard(shard, rows)
                    ok = sum(r["success"] for r in rows) / max(len(rows), 1)
                    bar.close(f"{label} {len(rows)} trajectories, oracle success {ok:.1%}")
            shard += 1
    # From every shard, so a run resumed after a crash still summarises the envs done before it.
    done = cast(pl.DataFrame, pl.from_arrow(w.read_shards().select(["env", "split", "success"])))
    summary: dict[str, float] = {}
    for (env, split), group in done.group_by("env", "split"):
        summary[f"{env}/{split}_demonstrations"] = float(group.height)
        if split == "train":
            summary[f"{env}/oracle_success"] = float(cast(float, group["success"].mean()))
    return w.commit(summary=summary)
