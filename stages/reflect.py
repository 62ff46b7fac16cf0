"""Stage ``reflect``: the round's failed explored trajectories, cut after their first flawed
step, continued by the policy from a reflection hint; the continuations that succeed are
revision trajectories (source=revision) that round sft trains on (ALGORITHMS.md, "Reflection by
hint"). The method is flywheel/reflect.py; this module selects, shards and writes.

Per env of the explore artifact: its failed rows (not those an env error ended), with
``reflect.n_tasks`` only those of the first N tasks with a failure, in shards of
``reflect.shard_size``. Each row is replayed through a fresh env for its per-step info (the rule
verifier's flags), cut (step hint after the first flawed step, else trajectory hint), hinted with
the suite's hint (``suite.hints``), and continued at ``reflect.temperature`` for up to the env's
``max_steps`` more steps, every trajectory of a shard in one engine call per step; a failed
continuation is reflected on again, up to ``reflect.max_evolve_times`` attempts. A kept row's
prefix is not trained (``loss=false``); the hinted turn (hint ids then generated ids, the hint's
log-probs 0.0) and the continuation are.

Killed in the middle, a rerun keeps the finished shards (a shard's seed is its index; its counts
ride in its Parquet footer). Summary per env: ``reflected`` (failed trajectories reflected on),
``attempts``, ``successes``, ``recovered_share`` (successes / reflected), ``skipped`` (replays
that failed or diverged: the env is not deterministic).

    flywheel stage reflect --round 1 iteration.data=[explore,reflect]
"""

from __future__ import annotations

import json
import time
from typing import Any, cast

import polars as pl

from data_contracts import table_from_rows
from flywheel.agent import derive_seed
from flywheel.config import Config
from flywheel.engines.base import Engine, SamplingParams
from flywheel.envs import EnvSuite, Task, make_suite
from flywheel.progress import Progress, say
from flywheel.reflect import evolve, hints_of
from flywheel.store import ArtifactRef, ArtifactWriter, Store
from stages._common import load_tasks, rollout_setup

COUNTS = ("reflected", "attempts", "successes", "skipped")
FOOTER_KEY = b"flywheel.reflect"  # a shard's counts, in its Parquet footer


def artifact_config(cfg: Config) -> dict[str, Any]:
    """What the artifact id hashes: the reflect section, engine and env settings, the seed,
    and the envs' hints (their text is in the trained turns)."""
    return {
        "reflect": cfg.reflect.model_dump(),
        "engine": cfg.engine_dump(),
        "envs": cfg.envs_dump(),
        "seed": cfg.run.seed,
        "hints": hints_of(cfg.envs),
    }


def run(
    cfg: Config,
    store: Store,
    explored: ArtifactRef,
    policy: ArtifactRef,
    tasks: ArtifactRef,
    *,
    round: int,
    force: bool = False,
) -> ArtifactRef:
    w = store.writer(
        "trajectories",
        stage="reflect",
        round=round,
        config=artifact_config(cfg),
        inputs=[explored.id, policy.id, tasks.id],
        force=force,
    )
    if w.cached:
        return w.ref
    rc = cfg.reflect
    plan = [
        (suite, chunk[start : start + rc.shard_size])
        for suite, chunk in _failures(cfg, store, explored, tasks)
        for start in range(0, len(chunk), rc.shard_size)
    ]
    if len(w.finished_shards()) < len(plan):
        with rollout_setup(
            cfg, store, policy, tasks, split="train", limit=1, label="reflect",
            needs_logprobs=True,
        ) as (engine, max_steps, _):  # fmt: skip
            _reflect_shards(cfg, w, engine, plan, max_steps, round=round, policy=policy.id)
    counts: dict[str, dict[str, float]] = {}
    for index, (suite, _) in enumerate(plan):
        c = counts.setdefault(suite.name, dict.fromkeys(COUNTS, 0.0))
        for key, value in _footer(w, index).items():
            c[key] += value
    for env, c in sorted(counts.items()):
        say(
            f"reflect: {env}: {c['successes']:.0f} of {c['reflected']:.0f} failed trajectories "
            f"recovered in {c['attempts']:.0f} attempts"
        )
    return w.commit(summary=_summary(counts))


def _failures(
    cfg: Config, store: Store, explored: ArtifactRef, tasks: ArtifactRef
) -> list[tuple[EnvSuite, list[tuple[Task, dict[str, Any]]]]]:
    """Per env (config order), its failed explored rows to reflect on, with their tasks."""
    frame = cast(pl.DataFrame, pl.from_arrow(store.read(explored)))
    frame = frame.filter(~pl.col("success") & (pl.col("finish_reason") != "error"))
    out = []
    for env_cfg in cfg.envs:
        rows = frame.filter(pl.col("env") == env_cfg.name).to_dicts()
        if not rows:
            continue
        suite = make_suite(env_cfg)
        if not getattr(suite, "hints", None):
            raise ValueError(
                f"reflect: env {env_cfg.name} gives no hints (its suite's hints), which open "
                "the reflection turn"
            )
        by_id = {t.task_id: t for t in load_tasks(store, tasks, env=env_cfg.name, split="train")}
        if cfg.reflect.n_tasks is not None:
            first = list(dict.fromkeys(r["task_id"] for r in rows))[: cfg.reflect.n_tasks]
            rows = [r for r in rows if r["task_id"] in set(first)]
        out.append((suite, [(by_id[r["task_id"]], r) for r in rows]))
    return out


def _reflect_shards(
    cfg: Config,
    writer: ArtifactWriter,
    engine: Engine,
    plan: list[tuple[EnvSuite, list[tuple[Task, dict[str, Any]]]]],
    max_steps: dict[str, int],
    *,
    round: int,
    policy: str,
) -> None:
    """Reflect on and write every shard of ``plan`` the writer does not have yet."""
    rc = cfg.reflect
    finished = set(writer.finished_shards())
    if finished:
        say(f"reflect: resuming, {len(finished)}/{len(plan)} shards already written")
    tokenizer = getattr(engine, "tokenizer", None)  # the hf and openai engines encode prompts
    if tokenizer is None:
        raise ValueError("reflect: the engine has no tokenizer to encode the hints with")
    encode = _encoder(tokenizer)
    total = sum(len(chunk) for _, chunk in plan)
    kept = sum(len(chunk) for i, (_, chunk) in enumerate(plan) if i in finished)
    with Progress("reflect:", total, unit="trajectories", done=kept) as bar:
        for index, (suite, chunk) in enumerate(plan):
            if index in finished:
                continue
            t0, start = time.time(), bar.done
            sampling = SamplingParams(
                temperature=rc.temperature, max_new_tokens=cfg.engine.max_new_tokens
            )

            def advance(settled: int, start: int = start) -> None:
                bar.update(start + settled - bar.done)

            reflections = evolve(
                engine, suite, chunk, encode=encode, sampling=sampling,
                max_steps=max_steps[suite.name], max_evolve_times=rc.max_evolve_times,
                seed=derive_seed(cfg.run.seed, "reflect", round, index),
                env_workers=cfg.engine.env_workers, progress=advance,
            )  # fmt: skip
            rows = [
                {**r.recovered.row(suite.name), "round": round, "policy": policy,
                 "source": "revision"}
                for r in reflections
                if r.recovered is not None
            ]  # fmt: skip
            counts = {
                "reflected": sum(r.skipped is None for r in reflections),
                "attempts": sum(r.attempts for r in reflections),
                "successes": len(rows),
                "skipped": sum(r.skipped is not None for r in reflections),
            }
            table = table_from_rows(writer.contract, rows, f"reflect shard {index}")
            meta = {**(table.schema.metadata or {}), FOOTER_KEY: json.dumps(counts).encode()}
            writer.write_shard(index, table.replace_schema_metadata(meta))
            bar.update(start + len(chunk) - bar.done)
            bar.note(
                f"reflect: shard {index + 1}/{len(plan)} {suite.name}: {counts['successes']} of "
                f"{counts['reflected']} recovered, {counts['attempts']} attempts, "
                f"{time.time() - t0:.1f}s"
            )


def _encoder(tokenizer: Any):
    """Hint text -> the ids that open the hinted turn; a hint the tokenizer cannot spell (the
    embedded tokenizer learns the hints only with reflect in iteration.data) is refused."""
    unk = getattr(tokenizer, "unk_token_id", None)

    def encode(hint: str) -> list[int]:
        ids = list(tokenizer.encode(hint, add_special_tokens=False))
        if unk is not None and unk in ids:
            raise ValueError(
                f"reflect: the policy's tokenizer cannot spell the hint {hint!r} (unknown "
                "words); the embedded tokenizer learns the hints at init when "
                "iteration.data holds reflect"
            )
        return ids

    return encode


def _footer(writer: ArtifactWriter, index: int) -> dict[str, float]:
    """The counts a finished shard carries in its footer."""
    meta = writer.read_shard(index, ["task_id"]).schema.metadata or {}
    return {k: float(v) for k, v in json.loads(meta[FOOTER_KEY]).items()}


def _summary(counts: dict[str, dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for env, c in sorted(counts.items()):
        out |= {f"{env}/{key}": c[key] for key in COUNTS}
        out[f"{env}/recovered_share"] = c["successes"] / max(c["reflected"], 1.0)
    return out
