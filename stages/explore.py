"""Stage ``explore``: K sampled rollouts of the current policy on every training task
(source=explore), with each turn's generated ids and behaviour log-probs kept.

Written in shards: killed in the middle, a rerun keeps the finished shards and does the rest.

    flywheel stage explore --round 1
"""

from __future__ import annotations

import polars as pl

from flywheel.agent import run_episodes
from flywheel.checkpoint import load_policy
from flywheel.config import Config
from flywheel.engines.base import SamplingParams
from flywheel.engines.hf import HFEngine
from flywheel.envs import make_suite
from flywheel.metrics import flatten, summarize
from flywheel.store import ArtifactRef, Store
from stages._common import load_tasks, run_in_shards, trajectory_rows


def run(cfg: Config, store: Store, policy: ArtifactRef, tasks: ArtifactRef, *, round: int, force: bool = False) -> ArtifactRef:
    w = store.writer(
        "trajectories",
        stage="explore",
        round=round,
        config=cfg.stage_inputs("explore"),
        inputs=[policy.id, tasks.id],
        force=force,
    )
    if w.cached:
        return w.ref
    ex = cfg.explore
    model, tokenizer = load_policy(store, policy)
    engine = HFEngine(model, tokenizer, batch_size=cfg.engine.batch_size)
    max_steps = {e.name: e.max_steps for e in cfg.envs}
    tasks_by_env = [
        (make_suite(e), load_tasks(store, tasks, env=e.name, split="train", limit=ex.n_tasks)) for e in cfg.envs
    ]

    def rollout(suite, chunk, shard):
        sampling = SamplingParams(
            temperature=ex.temperature,
            top_p=ex.top_p,
            max_new_tokens=cfg.engine.max_new_tokens,
            seed=cfg.run.seed * 1_000_003 + round * 10_007 + shard,
        )
        episodes = run_episodes(
            engine,
            suite,
            chunk,
            samples_per_task=ex.samples_per_task,
            sampling=sampling,
            max_steps=max_steps[suite.name],
            seed=sampling.seed,
            env_workers=cfg.engine.env_workers,
        )
        return trajectory_rows(episodes, round=round, policy=policy.id, source="explore")

    run_in_shards(
        w, tasks_by_env, shard_size=ex.shard_size, samples_per_task=ex.samples_per_task, rollout=rollout, label="explore"
    )
    frame = pl.from_arrow(w.read_shards().drop(["messages", "turn_token_ids", "turn_logprobs"]))
    return w.commit(summary=flatten(summarize(frame)))
