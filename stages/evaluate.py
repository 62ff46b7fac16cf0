"""Stage ``evaluate``: a checkpoint on the held-out test tasks of every env, greedy by default;
writes one eval row per episode and the metrics of ALGORITHMS.md per env in the summary.

Retrieval envs (tasks whose meta names ``gold_passages``, as ``wiki``'s do) also get
``recall_at_5``: the last step's ``info["retrieved"]`` lists the passages the episode retrieved.

Envs that branch natively (``snapshot()/restore()``: in-process and deterministic, e.g. craft
and arith) also get ``recovery_rate``: an episode's steps whose ``info`` flags ``invalid``,
``error`` or ``tool_error`` are counted; among the episodes with at least one, the share that
still succeeded (``flywheel.metrics``). An env that cannot be replayed exactly (a remote server,
a workflow) gets no recovery keys.

Both read the step infos of the episodes as this run played them. A shard a crashed run left
holds no infos (they are not a column): its episodes' actions are replayed through a fresh env,
which these envs, being deterministic, answer as they did, so the summary is the one an
uninterrupted run writes.

A policy whose weights equal those of a policy the store already evaluated on the same tasks
with the same decoding, engine and env settings (the same ``weights_sha256``: a DPO or GRPO step
that kept its start, a round that passed its policy on) is not played again: that evaluation's
episodes and summary are copied under this policy's id, and the manifest names it
(``reused_from``).

    flywheel stage evaluate --round 1
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from flywheel.agent import replay, run_episodes
from flywheel.config import Config
from flywheel.engines.base import SamplingParams
from flywheel.envs import EnvSuite, Task, make_suite
from flywheel.envs.base import has_snapshot
from flywheel.metrics import flatten, recall_at_k, summarize
from flywheel.progress import say
from flywheel.store import ArtifactError, ArtifactRef, Store
from stages._common import load_tasks, rollout_setup, run_in_shards

EVAL_KEYS = (
    "task_id",
    "env",
    "success",
    "reward",
    "steps",
    "tool_calls",
    "tool_errors",
    "tool_ok",
    "tokens",
    "finish_reason",
    "messages",
)
FAILED_KEYS = ("invalid", "error", "tool_error")  # a step's info flags: the action failed


def artifact_config(cfg: Config, policy: ArtifactRef) -> dict[str, Any]:
    """What the artifact id hashes: decoding, engine and env settings, and the kind of policy
    evaluated (its id is an input; its stage names the row of the report)."""
    return {
        "evaluate": cfg.evaluate.model_dump(exclude={"untrained", "val_tasks"}),
        "engine": cfg.engine_dump(),
        "envs": cfg.envs_dump(),
        "policy_stage": policy.stage,
    }


def run(
    cfg: Config,
    store: Store,
    policy: ArtifactRef,
    tasks: ArtifactRef,
    *,
    round: int,
    force: bool = False,
) -> ArtifactRef:
    w = store.writer(
        "eval",
        stage="evaluate",
        round=round,
        config=artifact_config(cfg, policy),
        inputs=[policy.id, tasks.id],
        force=force,
    )
    if w.cached:
        return w.ref
    # Reused only into an empty writer: shards a killed rollout left are finished instead.
    fresh = not force and not w.finished_shards()
    twin = evaluated_twin(cfg, store, policy, tasks) if fresh else None
    if twin is not None:
        print(
            f"evaluate: {policy.id} holds the weights of {twin.manifest['policy']} (same sha256); "
            f"the episodes of {twin.id} are reused",
            flush=True,
        )
        w.write_shard(0, relabel(store.read(twin), policy, round))
        # The same episodes give the same summary (recovery replays included): copied, not redone.
        return w.commit(summary=dict(twin.summary), extra=_extra(policy, reused_from=twin.id))
    ev = cfg.evaluate
    played: dict[tuple[str, str], list[dict]] = {}  # (env, task_id): its step infos as played
    with rollout_setup(
        cfg, store, policy, tasks, split="test", limit=ev.n_tasks, label="evaluate"
    ) as (
        engine,
        max_steps,
        tasks_by_env,
    ):

        def rollout(suite, chunk, shard, progress):
            sampling = SamplingParams(
                temperature=ev.temperature, max_new_tokens=cfg.engine.max_new_tokens, seed=shard
            )
            episodes = run_episodes(
                engine,
                suite,
                chunk,
                samples_per_task=1,
                sampling=sampling,
                max_steps=max_steps[suite.name],
                seed=shard,
                env_workers=cfg.engine.env_workers,
                progress=progress,
                with_infos=True,
            )
            played.update(((suite.name, ep["task_id"]), ep["infos"]) for ep in episodes)
            difficulty = {t.task_id: t.difficulty for t in chunk}
            return [
                {
                    **{k: ep[k] for k in EVAL_KEYS},
                    "difficulty": difficulty[ep["task_id"]],
                    "policy": policy.id,
                    "policy_stage": policy.stage,
                    "round": round,
                }
                for ep in episodes
            ]

        run_in_shards(
            w,
            tasks_by_env,
            shard_size=ev.shard_size,
            samples_per_task=1,
            rollout=rollout,
            label="evaluate",
        )
    table = w.read_shards()
    frame = cast(pl.DataFrame, pl.from_arrow(table.drop("messages")))
    replayed = replay_columns(cfg, store, tasks, table, played=played)
    if replayed is not None:
        frame = frame.join(replayed, on=["env", "task_id"], how="left")
    summary = flatten(summarize(frame))
    for (env, level), group in frame.group_by(["env", "difficulty"]):
        summary[f"{env}/success_rate_d{level}"] = float(cast(float, group["success"].mean()))
    return w.commit(summary=summary, extra=_extra(policy))


def _extra(policy: ArtifactRef, **more: str) -> dict[str, str]:
    """What an evaluation's manifest says of the policy it evaluated (the report's row)."""
    return {"policy": policy.id, "policy_stage": policy.stage, **more}


def evaluated_twin(
    cfg: Config, store: Store, policy: ArtifactRef, tasks: ArtifactRef
) -> ArtifactRef | None:
    """An evaluation in the store of another policy with ``policy``'s weights (its
    ``weights_sha256``), on the same tasks, with the same decoding, engine and env settings: its
    episodes are the ones this evaluation would play. None when there is none."""
    digest = policy.summary.get("weights_sha256")
    if not digest:
        return None
    want = json.loads(json.dumps(artifact_config(cfg, policy)))
    refs, _ = store.scan(stage="evaluate")  # a damaged evaluation elsewhere is not a twin
    for ref in refs:
        if ref.inputs[0] == policy.id or ref.inputs[1:] != [tasks.id]:
            continue
        config = ref.manifest.get("config", {})
        if any(config.get(key) != want[key] for key in ("evaluate", "engine", "envs")):
            continue
        try:
            other = store.get(ref.inputs[0])
        except ArtifactError:
            continue
        if other.summary.get("weights_sha256") == digest:
            return ref
    return None


def relabel(table: pa.Table, policy: ArtifactRef, round: int) -> pa.Table:
    """Another evaluation's episodes as this policy's: its id, stage and round on every row."""
    for name, value in (("policy", policy.id), ("policy_stage", policy.stage), ("round", round)):
        column = pa.array([value] * table.num_rows, type=table.schema.field(name).type)
        table = table.set_column(table.schema.get_field_index(name), name, column)
    return table


def replay_infos(suite: EnvSuite, task: Task, messages: list[dict[str, Any]]) -> list[dict]:
    """The ``info`` of every step of an episode: its actions (the assistant turns after the
    instruction and ``Ok.``) stepped again through a fresh env, until done
    (``flywheel.agent.replay``). A step that raises (the episode ended in an env error) gives
    ``{"error": ...}`` and ends the replay."""
    return replay(suite, task, messages).infos


def count_failed(infos: list[dict]) -> int:
    """Steps whose info says the action failed (unparsable, an env error, a failed tool call)."""
    return sum(any(bool(info.get(key)) for key in FAILED_KEYS) for info in infos)


def _replayable(suite: EnvSuite) -> bool:
    env = suite.make()
    try:
        return has_snapshot(env)
    finally:
        env.close()


def replay_columns(
    cfg: Config,
    store: Store,
    tasks: ArtifactRef,
    table: pa.Table,
    *,
    recall: bool = True,
    failed: bool = True,
    played: Mapping[tuple[str, str], list[dict]] | None = None,
) -> pl.DataFrame | None:
    """(env, task_id, recall_at_5 and/or failed_actions) of every episode of the envs that
    give them: ``recall_at_5`` for tasks that name their gold passages, ``failed_actions`` for
    envs that branch natively. Both come from an episode's step infos: those in ``played``
    (keyed by (env, task_id): the episodes this run played) as they are, any other episode's
    (a shard a crashed run left) by replaying it once through a fresh env (in parallel threads:
    a tool call may run a sandboxed process), which these envs, being deterministic, answer
    the same way. None when no env gives either column."""
    resumed = played is not None  # given what this run played: the rest a crashed run left
    played = played or {}
    rows: list[dict[str, Any]] = []
    columns: set[str] = set()  # what some env computed: rows of the others hold nulls there
    for env_cfg in cfg.envs:
        suite = make_suite(env_cfg)
        by_id = {t.task_id: t for t in load_tasks(store, tasks, env=env_cfg.name, split="test")}
        gold = recall and any(t.meta.get("gold_passages") for t in by_id.values())
        count = failed and _replayable(suite)
        if not (gold or count):
            continue
        episodes = table.filter(pc.equal(table["env"], env_cfg.name))
        task_ids = episodes.column("task_id").to_pylist()
        unplayed = pa.array([(env_cfg.name, t) not in played for t in task_ids], pa.bool_())
        missing = episodes.filter(unplayed).select(["task_id", "messages"]).to_pylist()
        if resumed and missing:
            say(
                f"evaluate: replaying the {len(missing)} {env_cfg.name} episodes a crashed run left"
            )

        def replay(ep: dict[str, Any], suite: EnvSuite = suite, by_id=by_id) -> list[dict]:
            return replay_infos(suite, by_id[ep["task_id"]], ep["messages"])

        with ThreadPoolExecutor(max_workers=max(1, cfg.engine.env_workers)) as pool:
            found = list(pool.map(replay, missing))
        replayed = dict(zip([ep["task_id"] for ep in missing], found, strict=True))
        replays = [replayed[t] if t in replayed else played[(env_cfg.name, t)] for t in task_ids]
        columns |= {"recall_at_5"} if gold else set()
        columns |= {"failed_actions"} if count else set()
        for task_id, infos in zip(task_ids, replays, strict=True):
            row: dict[str, Any] = {"env": env_cfg.name, "task_id": task_id}
            passages = by_id[task_id].meta.get("gold_passages")
            retrieved = list(infos[-1].get("retrieved", [])) if infos else []
            row["recall_at_5"] = recall_at_k(retrieved, passages) if gold and passages else None
            row["failed_actions"] = count_failed(infos) if count else None
            rows.append(row)
    if not rows:
        return None
    schema = {"env": pl.String, "task_id": pl.String, "recall_at_5": pl.Float64}
    frame = pl.DataFrame(rows, schema=schema | {"failed_actions": pl.Int64})
    return frame.select("env", "task_id", *sorted(columns))


def failed_actions(
    cfg: Config, store: Store, tasks: ArtifactRef, table: pa.Table
) -> pl.DataFrame | None:
    """(env, task_id, failed_actions) of every episode of the envs that branch natively; None
    when no env does."""
    found = replay_columns(cfg, store, tasks, table, recall=False)
    return None if found is None else found.select("env", "task_id", "failed_actions")


def retrieval_recall(
    cfg: Config, store: Store, tasks: ArtifactRef, table: pa.Table
) -> pl.DataFrame | None:
    """(env, task_id, recall_at_5) of every episode whose task names its gold passages; None
    when no env has such tasks."""
    found = replay_columns(cfg, store, tasks, table, failed=False)
    if found is None:
        return None
    return found.filter(pl.col("recall_at_5").is_not_null()).select("env", "task_id", "recall_at_5")
