"""Stage ``rft`` (a baseline): rejection-sampling fine-tuning. The bootstrap SFT policy trained
with SFT on the policy's own successful explored trajectories, from the same explore data the
rounds used (ETO's and ET-Agent's RFT row).

Per task, the successful samples of every round's explore artifact are ranked by Pareto rank
(reward up, tool calls down, tokens down) and the best ``rft.per_task`` with distinct assistant
text are kept. With ``rft.with_expert`` (the default, as in ETO) the expert trajectories of the
train split are trained on as well. With ``rft.val_every`` it keeps the best validated checkpoint.

    flywheel stage rft --round 2      # after the last round (baselines: [rft])
"""

from __future__ import annotations

from functools import partial
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
from flywheel.config import Config
from flywheel.pareto import trajectory_ranks
from flywheel.progress import say
from flywheel.store import ArtifactRef, Store
from flywheel.training.launch import run_training
from stages._common import (
    start_validation,
    validation,
    validation_config,
    validation_inputs,
)
from stages.sft import encode_rows


def artifact_config(cfg: Config) -> dict[str, Any]:
    """What the artifact id hashes: the rft section, the seed and what validation reads."""
    return {
        "rft": cfg.rft.artifact_dump(),
        "seed": cfg.baseline_seed(cfg.rft),
        "validation": validation_config(cfg, cfg.rft),
    }


def select_successes(explored: pl.DataFrame, per_task: int) -> pl.DataFrame:
    """The successful train-split samples, best Pareto rank first per task, at most
    ``per_task`` per task, each assistant text once per task."""
    if explored.is_empty():
        return explored
    # Ranks among all K samples of a task (failures included), then the successes only.
    ranked = explored.with_columns(pareto_rank=pl.Series(trajectory_ranks(explored)))
    ok = ranked.filter(pl.col("success").fill_null(False) & (pl.col("split") == "train"))
    text = pl.col("messages").list.eval(
        pl.when(pl.element().struct.field("role") == "assistant")
        .then(pl.element().struct.field("content"))
        .otherwise(pl.lit(None))
    )
    return (
        ok.with_columns(_text=text.list.drop_nulls().list.join("\n"))
        .sort("env", "task_id", "pareto_rank", "tokens", "round", "sample_idx")
        .unique(["env", "task_id", "_text"], keep="first", maintain_order=True)
        .with_columns(_k=pl.int_range(pl.len()).over("env", "task_id"))
        .filter(pl.col("_k") < per_task)
        .drop("_text", "_k", "pareto_rank")
    )


def run(
    cfg: Config,
    store: Store,
    policy: ArtifactRef,
    explored: list[ArtifactRef],
    expert: ArtifactRef,
    *,
    round: int,
    val_tasks: ArtifactRef | None = None,
    val_demos: ArtifactRef | None = None,
    log=None,
    force: bool = False,
) -> ArtifactRef:
    rc = cfg.rft
    inputs = [policy.id, *(e.id for e in explored)] + ([expert.id] if rc.with_expert else [])
    w = store.writer(
        "checkpoints",
        stage="rft",
        round=round,
        config=artifact_config(cfg),
        inputs=inputs + validation_inputs(rc, val_tasks, val_demos),
        force=force,
    )
    if w.cached:
        return w.ref
    frames = [cast(pl.DataFrame, pl.from_arrow(store.read(ref))) for ref in explored]
    chosen = select_successes(pl.concat(frames), rc.per_task) if frames else pl.DataFrame()
    model, tokenizer = load_policy(store, policy)
    examples = encode_rows(chosen, tokenizer) if not chosen.is_empty() else []
    n_own = len(examples)
    if rc.with_expert:
        gold = cast(pl.DataFrame, pl.from_arrow(store.read(expert)))
        examples += encode_rows(gold.filter(pl.col("split") == "train"), tokenizer)
    if not examples:
        # Nothing succeeded and nothing was demonstrated: rejection sampling keeps nothing, and
        # the baseline is the policy it started from.
        return unchanged_checkpoint(
            w, store, policy, stage="rft", round=round,
            reason="no successful explored trajectories and no demonstrations",
        )  # fmt: skip
    out = w.local_dir()
    num_params = sum(p.numel() for p in model.parameters())
    tasks = chosen.select("env", "task_id").n_unique() if n_own else 0
    say(
        f"rft: {n_own} successful trajectories of {tasks} tasks"
        + (f" + {len(examples) - n_own} expert" if rc.with_expert else "")
    )
    start_key, known = start_validation(cfg, rc, store, policy, val_tasks, val_demos)
    result = run_training(
        model, examples, model_dir=checkpoint_dir(store, policy), loss="sft", cfg=rc,
        seed=cfg.baseline_seed(rc), out_dir=out, log=log, log_every=cfg.run.log_every,
        validation=partial(validation, cfg, rc, store, tokenizer, val_tasks, val_demos),
        start_validation=known, label="rft",
    )  # fmt: skip
    write_train_log(out, result.history)
    return write_checkpoint(
        w, model, tokenizer, policy="rft", round=round, parent=policy.id,
        base=policy.summary.get("base", ""), train_steps=result.steps,
        final_loss=result.final_loss,
        summary={"examples": len(examples), "own_successes": n_own, "tasks_solved": tasks,
                 **train_summary(result, start_key)},
        save_model=False, num_params=num_params,
    )  # fmt: skip
