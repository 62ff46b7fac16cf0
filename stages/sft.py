"""Stage ``sft``: masked cross-entropy on trajectories, from a checkpoint to a new checkpoint.

Round 0 trains pi_init on the expert trajectories of the train split until validation stops
improving (``sft.val_every``, ``sft.val_metric``: the val split's expert trajectories' loss, or
greedy success on the val tasks; ``sft.patience``; ``sft.max_steps`` caps it), and keeps the best
validated weights, so the bootstrap policy is converged without hand-tuning epochs. In later
rounds it trains on the round's own data (``iteration.data``): the successful explored
trajectories, and the splice stage's revision trajectories (source=revision: only the revision
turn and the good continuation carry ``loss=true``) with the trees' good paths (source=mcts);
with ``sft.replay`` also the successes of the earlier rounds' explorations.
Only assistant turns with ``loss=true`` are trained; sampled turns are trained on their stored
ids. Val-split rows are never trained on.

    flywheel stage sft --round 0
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

import polars as pl

from flywheel.checkpoint import (
    checkpoint_dir,
    load_policy,
    train_summary,
    unchanged_checkpoint,
    write_checkpoint,
    write_train_log,
)
from flywheel.config import Config, SftConfig
from flywheel.progress import say
from flywheel.store import ArtifactRef, Store
from flywheel.training.launch import run_training
from flywheel.training.loop import TrainResult
from flywheel.trajectory import Trajectory
from stages._common import (
    start_validation,
    validation,
    validation_config,
    validation_inputs,
)

# Read by the SFT steps of rounds >= 1 only.
ROUND_FIELDS = {"with_expert", "round_val_metric", "round_lr", "round_patience", "replay"}
# Read by round 0 only.
BOOTSTRAP_FIELDS = {"restarts", "restart_until"}
# Where sft.restarts trains each run, inside the artifact's folder, and what each leaves there.
RESTART_DIR, RESTART_RESULT = "restart", "result.json"


def section(cfg: Config, round: int) -> SftConfig:
    """The sft section as round ``round`` trains with it: rounds >= 1 validate by
    round_val_metric and train at round_lr and stop at round_patience (when set)."""
    if round == 0:
        return cfg.sft
    update: dict[str, Any] = {"val_metric": cfg.sft.round_val_metric}
    if cfg.sft.round_lr is not None:
        update["lr"] = cfg.sft.round_lr
    if cfg.sft.round_patience is not None:
        update["patience"] = cfg.sft.round_patience
    return cfg.sft.model_copy(update=update)


def artifact_config(cfg: Config, round: int) -> dict[str, Any]:
    """What the artifact id hashes: the sft section (the round fields only in rounds >= 1, where
    they apply), the seed and what validation reads."""
    sc = section(cfg, round)
    return {
        "sft": sc.artifact_dump(exclude=ROUND_FIELDS if round == 0 else BOOTSTRAP_FIELDS),
        "seed": cfg.train_seed,
        "validation": validation_config(cfg, sc),
    }


def encode_rows(frame: pl.DataFrame, tokenizer: Any) -> list[dict[str, list[int]]]:
    """Trajectory rows -> sft examples (sampled turns on their stored ids, the rest from text)."""
    examples = []
    for row in frame.select("messages", "turn_token_ids").iter_rows(named=True):
        ids, mask = Trajectory.from_row(row).encode(tokenizer)
        examples.append({"input_ids": ids, "loss_mask": mask})
    return examples


def examples_from(
    store: Store, data: list[ArtifactRef], tokenizer: Any
) -> list[dict[str, list[int]]]:
    """Train-split rows only; expert, revision and mcts rows (splice writes good paths only)
    are all trained, explored rows only when they succeeded."""
    frames = [cast(pl.DataFrame, pl.from_arrow(store.read(ref))) for ref in data]
    frame = pl.concat(frames) if frames else pl.DataFrame()
    if frame.is_empty():
        return []
    keep = frame.filter(
        (pl.col("split") == "train") & ((pl.col("source") != "explore") | pl.col("success"))
    )
    return encode_rows(keep, tokenizer)


def run(
    cfg: Config,
    store: Store,
    policy: ArtifactRef,
    data: list[ArtifactRef],
    *,
    round: int,
    val_tasks: ArtifactRef | None = None,
    val_demos: ArtifactRef | None = None,
    log=None,
    force: bool = False,
) -> ArtifactRef:
    sc = section(cfg, round)
    val_ids = validation_inputs(sc, val_tasks, val_demos)
    w = store.writer(
        "checkpoints",
        stage="sft",
        round=round,
        config=artifact_config(cfg, round),
        inputs=[policy.id, *(d.id for d in data), *val_ids],
        force=force,
    )
    if w.cached:
        return w.ref
    model, tokenizer = load_policy(store, policy)
    examples = examples_from(store, data, tokenizer)
    if not examples:
        # Round 0 without demonstrations (envs without an oracle or imported data) starts the
        # rounds from the initial policy, which then learns from rewards; a later round whose
        # exploration found no success has nothing to imitate. Either way: pass the policy on.
        reason = (
            "no demonstrations (no oracle, no imported data)"
            if round == 0
            else ("no successful trajectories")
        )
        return unchanged_checkpoint(w, store, policy, stage="sft", round=round, reason=reason)
    out = w.local_dir()
    num_params = sum(p.numel() for p in model.parameters())
    say(f"sft: round {round}, {len(examples)} trajectories from {', '.join(d.id for d in data)}")
    start_key, known = start_validation(cfg, sc, store, policy, val_tasks, val_demos)
    train = partial(
        run_training, examples=examples, model_dir=checkpoint_dir(store, policy), loss="sft",
        cfg=sc, log_every=cfg.run.log_every, start_validation=known,
        validation=partial(validation, cfg, sc, store, tokenizer, val_tasks, val_demos),
    )  # fmt: skip
    extra: dict[str, Any] = {}
    if round == 0 and sc.restarts > 1:
        result, extra["restarts"] = train_restarts(
            train, store, policy, model, out, cfg.train_seed, sc.restarts, log,
            until=sc.restart_until,
        )  # fmt: skip
    else:
        result = train(model, seed=cfg.train_seed, out_dir=out, log=log)
    write_train_log(out, result.history)
    return write_checkpoint(
        w, model, tokenizer, policy="sft", round=round, parent=policy.id,
        base=policy.summary.get("base", ""), train_steps=result.steps,
        final_loss=result.final_loss,
        summary={"examples": len(examples), **train_summary(result, start_key), **extra},
        save_model=False, num_params=num_params,
    )  # fmt: skip


def train_restarts(
    train: Callable[..., TrainResult],
    store: Store,
    policy: ArtifactRef,
    model: Any,
    out: Path,
    seed: int,
    restarts: int,
    log: Callable[[dict], None] | None,
    until: float | None = None,
) -> tuple[TrainResult, list[dict[str, Any]]]:
    """The bootstrap trained ``restarts`` times from ``policy`` with data orders seed, seed + 1,
    ...; the run with the best validation score (the earliest on a tie) is kept: its weights
    are moved into ``out`` and its records go to ``log``. Each run trains in
    ``out/restart-K`` and leaves its TrainResult there (``result.json``), so a rerun after a
    crash keeps the runs that finished (and resumes the one that did not from its train
    state); once all have finished only those results stay, as the artifact's record of the
    runs it chose from. With ``until``, no further run starts once one reaches that best
    validation score. Returns the kept run's result and one summary row per run made."""
    results: list[TrainResult] = []
    for k in range(restarts):
        folder = out / f"{RESTART_DIR}-{k}"
        done = folder / RESTART_RESULT
        if done.is_file():
            results.append(TrainResult(**json.loads(done.read_text())))
            say(f"sft: restart {k + 1}/{restarts} (seed {seed + k}) finished before: read back")
        else:
            say(f"sft: restart {k + 1}/{restarts}, data order seed {seed + k}")
            start = model if k == 0 else load_policy(store, policy)[0]
            result = train(start, seed=seed + k, out_dir=folder, log=None)
            tmp = done.with_suffix(".tmp")
            tmp.write_text(json.dumps(dataclasses.asdict(result)))
            os.replace(tmp, done)  # a rerun never reads half a result
            results.append(result)
        score = results[-1].best_score
        if until is not None and k + 1 < restarts and score is not None and score >= until:
            say(
                f"sft: restart {k + 1}/{restarts} reached val score {score:.4f} "
                f"(restart_until {until}): no further restarts"
            )
            break
    made = len(results)
    scores = [r.best_score if r.best_score is not None else -math.inf for r in results]
    best = max(range(made), key=lambda k: (scores[k], -k))
    chosen = out / f"{RESTART_DIR}-{best}"
    for item in chosen.iterdir():  # a rerun after a crash here moves what is left
        if item.name != RESTART_RESULT and not item.name.startswith("_"):
            target = out / item.name
            if target.is_dir():
                shutil.rmtree(target)
            os.replace(item, target)
    for k in range(made):  # the kept weights are in `out` now; the others are not kept
        for item in (out / f"{RESTART_DIR}-{k}").iterdir():
            if item.name != RESTART_RESULT:
                shutil.rmtree(item) if item.is_dir() else item.unlink()
    rows = [
        {
            "seed": seed + k, "best_step": r.best_step, "best_score": r.best_score,
            "steps": r.steps, "stop_reason": r.stop_reason, "train_tokens": r.tokens,
            "train_time_s": r.train_time_s, "kept": k == best,
        }
        for k, r in enumerate(results)
    ]  # fmt: skip
    others = ", ".join(f"seed {seed + k}: {scores[k]:.4f}" for k in range(made) if k != best)
    say(
        f"sft: kept restart {best + 1}/{restarts} (seed {seed + best}, val score "
        f"{scores[best]:.4f}{'; ' + others if others else ''})"
    )
    if log is not None:
        for record in results[best].history:
            if "loss" in record:  # not the validation before the first step
                log(record)
    return results[best], rows
