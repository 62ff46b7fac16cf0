"""Small pieces several stages share: reading tasks, shaping trajectory rows, and running
episodes shard by shard so a crash keeps the finished shards."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import polars as pl

from flywheel.envs import EnvSuite, Task, row_to_task
from flywheel.progress import Progress, say
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
    held = tasks.manifest.get("split")
    if held is not None and held != split:
        raise ValueError(f"{tasks.id} holds the {held} split, not {split}")
    frame = cast(pl.DataFrame, pl.from_arrow(store.read(tasks))).filter(
        (pl.col("env") == env) & (pl.col("split") == split)
    )
    if limit is not None and frame.height > 0:
        start = (window * limit) % frame.height
        frame = pl.concat([frame.slice(start), frame.slice(0, start)]).head(limit)
    return [row_to_task(r) for r in frame.iter_rows(named=True)]


@contextmanager
def rollout_setup(
    cfg: Any,
    store: Store,
    policy: ArtifactRef,
    tasks: ArtifactRef,
    *,
    split: str,
    limit: int | None,
    window: int = 0,
    label: str,
    needs_logprobs: bool = False,
) -> Iterator[tuple[Any, dict[str, int], list[tuple[EnvSuite, list[Task]]]]]:
    """What explore and evaluate both start from: an engine on the policy (closed on exit, with
    the server it started, if any), each env's step limit, and each env's suite with its tasks
    of ``split`` (see ``load_tasks`` for ``window``)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from flywheel.checkpoint import checkpoint_dir, load_policy
    from flywheel.engines import open_engine
    from flywheel.envs import make_suite

    max_steps = {e.name: e.max_steps for e in cfg.envs}
    tasks_by_env = [
        (
            make_suite(e),
            load_tasks(store, tasks, env=e.name, split=split, limit=limit, window=window),
        )
        for e in cfg.envs
    ]
    folder = checkpoint_dir(store, policy)
    if cfg.engine.kind == "hf":
        model, tokenizer = load_policy(store, policy)
    else:  # a server holds the weights; the stage only encodes prompts
        model, tokenizer = None, AutoTokenizer.from_pretrained(folder)
    with open_engine(
        cfg.engine,
        tokenizer,
        model=model,
        checkpoint=folder,
        work_dir=Path(cfg.run.work_dir),
        label=label,
        needs_logprobs=needs_logprobs,
    ) as engine:
        yield engine, max_steps, tasks_by_env


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
    rollout: Callable[
        [EnvSuite, list[Task], int, Callable[[int, int], None]], list[dict[str, Any]]
    ],
    label: str,
) -> None:
    """Cut every env's tasks into shards of about ``shard_size`` episodes (a task's K samples
    stay in one shard), run the shards the writer does not have yet, write each as it ends.

    ``rollout(suite, tasks, shard_index, progress)`` returns the shard's rows; the shard index
    seeds it, so a shard redone after a crash samples the same way. ``progress(finished, total)``
    (the agent loop's callback) moves the progress bar episode by episode; each written shard
    prints its line (``explore: shard 2/5 arith: 8 episodes, success 50.0%, ...``)."""
    tasks_per_shard = max(1, shard_size // samples_per_task)
    plan = []
    for suite, tasks in tasks_by_env:
        for start in range(0, len(tasks), tasks_per_shard):
            plan.append((suite, tasks[start : start + tasks_per_shard]))
    finished = set(writer.finished_shards())
    # A shard with episodes an env failed (a server that died) is written, so what happened is
    # on disk, but it does not count as finished: the artifact is not committed, and a rerun
    # plays the shard again.
    retry = {
        i for i in finished if _env_errors(writer.read_shard(i, ["finish_reason"]).to_pylist())
    }
    finished -= retry
    if finished or retry:
        again = f", {len(retry)} with env errors to retry" if retry else ""
        say(f"{label}: resuming, {len(finished)}/{len(plan)} shards already written{again}")
    failed: list[tuple[int, dict[str, Any]]] = []
    total = sum(len(chunk) for _, chunk in plan) * samples_per_task
    kept = sum(len(chunk) for i, (_, chunk) in enumerate(plan) if i in finished)
    with Progress(f"{label}:", total, unit="episodes", done=kept * samples_per_task) as bar:
        for index, (suite, chunk) in enumerate(plan):
            if index in finished:
                continue
            t0, start = time.time(), bar.done

            def advance(episodes: int, _total: int, start: int = start) -> None:
                bar.update(start + episodes - bar.done)

            rows = rollout(suite, chunk, index, advance)
            writer.write_shard(index, rows)
            failed += [(index, r) for r in rows if r.get("finish_reason") == "error"]
            tokens = sum(int(r.get("tokens") or 0) for r in rows)
            bar.update(start + len(rows) - bar.done, tokens=tokens)
            ok = sum(r["success"] for r in rows) / max(len(rows), 1)
            took = max(time.time() - t0, 1e-9)
            bar.note(
                f"{label}: shard {index + 1}/{len(plan)} {suite.name}: {len(rows)} episodes, "
                f"success {ok:.1%}, {took:.1f}s, {len(rows) / took:.2f} episodes/s, "
                f"{tokens / took:.0f} tok/s"
            )
    if failed:
        shards = len({i for i, _ in failed})
        first = failed[0][1]["messages"][-1]["content"]
        raise EnvFailure(
            f"{label}: {len(failed)} episodes in {shards} shard{'s' * (shards != 1)} ended with an "
            f"env error "
            f"(first: {first.splitlines()[0] if first else '?'}); the shards without errors are "
            f"kept: rerun to play the others again"
        )


class EnvFailure(RuntimeError):
    """Episodes an environment failed (its server died, a reset raised): the stage stops
    without committing; the message is one line."""


def _env_errors(rows: list[dict[str, Any]]) -> bool:
    return any(r.get("finish_reason") == "error" for r in rows)


def validation_config(cfg: Any, section: Any) -> dict[str, Any] | None:
    """What a training stage's validation adds to its artifact id (None when it does not validate)."""
    if not section.val_every:
        return None
    if section.val_metric == "loss":
        return {"metric": "loss"}
    return {
        "metric": "success",
        "val_tasks": cfg.evaluate.val_tasks,
        "engine": cfg.engine_dump(),
        "envs": cfg.envs_dump(),
    }


def validation_inputs(
    section: Any, val_tasks: ArtifactRef | None, val_demos: ArtifactRef | None
) -> list[str]:
    """The ids of the artifacts a training stage's validation reads (for its inputs): the
    expert artifact (its val rows) for loss, the val tasks for success; [] without validation."""
    if not section.val_every:
        return []
    ref, what = (
        (val_demos, "the expert artifact (its val split rows)")
        if section.val_metric == "loss"
        else (val_tasks, "the val tasks artifact")
    )
    if ref is None:
        raise ValueError(f"validation by {section.val_metric} needs {what}")
    return [ref.id]


def start_validation(
    cfg: Any,
    section: Any,
    store: Store,
    policy: ArtifactRef,
    val_tasks: ArtifactRef | None,
    val_demos: ArtifactRef | None,
) -> tuple[str | None, dict[str, float] | None]:
    """What a training stage's validation before its first step measures, as a key (the
    starting weights' ``weights_sha256``, the validation's settings and the artifacts it reads),
    and the numbers a checkpoint in the store recorded under that key (``val_start`` in its
    summary, ``flywheel.checkpoint.train_summary``), if any: the loop then takes them instead of
    validating the same weights the same way again (the demo's DPO rounds, ``sft_more`` and
    ``rft`` all start from the SFT policy). (None, None) without validation or a digest."""
    digest = policy.summary.get("weights_sha256")
    settings = validation_config(cfg, section)
    if not digest or settings is None:
        return None, None
    if settings["metric"] == "loss":
        settings = settings | {"max_length": section.max_length}
    val_ids = validation_inputs(section, val_tasks, val_demos)
    blob = json.dumps([digest, settings, val_ids], sort_keys=True, default=str)
    key = hashlib.sha256(blob.encode()).hexdigest()[:16]
    refs, _ = store.scan()  # a damaged artifact elsewhere in the store must not stop training
    for ref in refs:
        start = ref.summary.get("val_start") if ref.kind == "checkpoints" else None
        if isinstance(start, dict) and start.get("key") == key:
            return key, {k: float(v) for k, v in start.items() if k != "key"}
    return key, None


def validation(
    cfg: Any,
    section: Any,
    store: Store,
    tokenizer: Any,
    val_tasks: ArtifactRef | None,
    val_demos: ArtifactRef | None,
) -> Callable[[Any], dict[str, float]] | None:
    """The ``validate(module)`` callback a training stage hands the loop; None when
    ``section.val_every`` is 0.

    loss: token-mean masked CE on the val split's expert trajectories (score = -loss);
    success: greedy success rate on the first ``evaluate.val_tasks`` val tasks of every env.
    Only val-split artifacts are read: the test split never selects a checkpoint."""
    if not validation_inputs(section, val_tasks, val_demos):
        return None
    if section.val_metric == "loss":
        assert val_demos is not None
        return _val_loss(store, section, tokenizer, val_demos)
    assert val_tasks is not None
    return _val_success(cfg, store, tokenizer, val_tasks)


def _val_loss(
    store: Store, section: Any, tokenizer: Any, demos: ArtifactRef
) -> Callable[[Any], dict[str, float]]:
    from flywheel.chat import encode_chat
    from flywheel.training.loop import validation_loss

    frame = cast(pl.DataFrame, pl.from_arrow(store.read(demos, columns=["split", "messages"])))
    rows = frame.filter(pl.col("split") == "val")["messages"].to_list()
    if not rows:
        raise ValueError(f"{demos.id} holds no val-split trajectories to validate on (envs n_val)")
    examples = []
    for messages in rows:
        ids, mask = encode_chat(tokenizer, messages)
        examples.append({"input_ids": ids, "loss_mask": mask})

    def validate(module: Any) -> dict[str, float]:
        loss = validation_loss(
            module, examples, batch_size=section.micro_batch_size, max_length=section.max_length
        )
        return {"score": -loss, "val_loss": loss}

    return validate


def _val_success(
    cfg: Any, store: Store, tokenizer: Any, val_tasks: ArtifactRef
) -> Callable[[Any], dict[str, float]]:
    from flywheel.agent import run_episodes
    from flywheel.engines import open_engine
    from flywheel.engines.base import SamplingParams
    from flywheel.envs import make_suite

    limit = cfg.evaluate.val_tasks
    by_env = [
        (e, make_suite(e), load_tasks(store, val_tasks, env=e.name, split="val", limit=limit))
        for e in cfg.envs
    ]
    if not any(tasks for _, _, tasks in by_env):
        raise ValueError(f"{val_tasks.id} holds no val tasks to validate on (envs n_val)")
    sampling = SamplingParams(temperature=0.0, max_new_tokens=cfg.engine.max_new_tokens, seed=0)

    def validate(module: Any) -> dict[str, float]:
        device = str(next(module.parameters()).device)  # stay where the training put it
        ok = n = 0
        # The weights in training live here, not on a server: validation always runs them in-process.
        hf = cfg.engine.model_copy(update={"kind": "hf"})
        with open_engine(hf, tokenizer, model=module, device=device) as engine:
            for env_cfg, suite, tasks in by_env:
                episodes = run_episodes(
                    engine, suite, tasks, sampling=sampling, max_steps=env_cfg.max_steps,
                    env_workers=cfg.engine.env_workers,
                )  # fmt: skip
                ok += sum(bool(ep["success"]) for ep in episodes)
                n += len(episodes)
        return {"score": ok / n, "val_success": ok / n}

    return validate
