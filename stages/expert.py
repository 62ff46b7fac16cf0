"""Stage ``expert``: trajectories of every env's oracle on the training tasks (source=expert).

Each oracle turn is stepped through a real env, so the stored observations and rewards are what
the env really returns; an oracle that fails a task is reported in the summary.

    flywheel stage expert --round 0
"""

from __future__ import annotations

from typing import cast

import polars as pl

from flywheel.agent import expert_episodes
from flywheel.config import Config
from flywheel.envs import make_suite
from flywheel.store import ArtifactRef, Store
from stages._common import load_tasks, trajectory_rows


def run(cfg: Config, store: Store, tasks: ArtifactRef, *, force: bool = False) -> ArtifactRef:
    w = store.writer(
        "trajectories",
        stage="expert",
        round=0,
        config=cfg.stage_inputs("expert"),
        inputs=[tasks.id],
        force=force,
    )
    if w.cached:
        return w.ref
    for shard, env_cfg in enumerate(cfg.envs):
        if w.has_shard(shard):
            continue
        suite = make_suite(env_cfg)
        env_tasks = load_tasks(store, tasks, env=env_cfg.name, split="train")
        episodes = expert_episodes(suite, env_tasks)
        rows = trajectory_rows(episodes, round=0, policy="oracle", source="expert")
        w.write_shard(shard, rows)
        ok = sum(r["success"] for r in rows) / max(len(rows), 1)
        print(f"expert: {env_cfg.name}: {len(rows)} trajectories, oracle success {ok:.1%}")
    # From every shard, so a run resumed after a crash still summarises the envs done before it.
    done = cast(pl.DataFrame, pl.from_arrow(w.read_shards().select(["env", "success"])))
    summary = {
        f"{env}/oracle_success": float(cast(float, group["success"].mean()))
        for (env,), group in done.group_by("env")
    }
    return w.commit(summary=summary)
