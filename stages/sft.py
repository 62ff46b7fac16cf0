"""Stage ``sft``: masked cross-entropy on trajectories, from a checkpoint to a new checkpoint.

Round 0 trains pi_init on the expert trajectories. In later rounds it trains on the round's
successful explored trajectories (good paths; revisions join them once splice exists). Only
assistant turns with ``loss=true`` are trained; sampled turns are trained on their stored ids.

    flywheel stage sft --round 0
"""

from __future__ import annotations

from typing import Any, cast

import polars as pl

from flywheel.chat import align_turn_ids, encode_chat
from flywheel.checkpoint import load_policy, unchanged_checkpoint, write_checkpoint, write_train_log
from flywheel.config import Config, TrainSection
from flywheel.store import ArtifactRef, Store
from flywheel.training.loop import TrainConfig, train


def train_config(section: TrainSection, seed: int, **extra: Any) -> TrainConfig:
    return TrainConfig(**section.model_dump(), seed=seed, **extra)


def examples_from(
    store: Store, data: list[ArtifactRef], tokenizer: Any
) -> list[dict[str, list[int]]]:
    """Expert and revision rows are all trained; explored rows only when they succeeded."""
    frames = [cast(pl.DataFrame, pl.from_arrow(store.read(ref))) for ref in data]
    frame = pl.concat(frames) if frames else pl.DataFrame()
    keep = frame.filter((pl.col("source") != "explore") | pl.col("success"))
    examples = []
    for row in keep.select("messages", "turn_token_ids").iter_rows(named=True):
        turn_ids = align_turn_ids(row["messages"], row["turn_token_ids"] or [])
        ids, mask = encode_chat(tokenizer, row["messages"], turn_ids)
        examples.append({"input_ids": ids, "loss_mask": mask})
    return examples


def run(
    cfg: Config,
    store: Store,
    policy: ArtifactRef,
    data: list[ArtifactRef],
    *,
    round: int,
    log=None,
    force: bool = False,
) -> ArtifactRef:
    w = store.writer(
        "checkpoints",
        stage="sft",
        round=round,
        config=cfg.stage_inputs("sft"),
        inputs=[policy.id, *(d.id for d in data)],
        force=force,
    )
    if w.cached:
        return w.ref
    model, tokenizer = load_policy(store, policy)
    examples = examples_from(store, data, tokenizer)
    if not examples:
        if round == 0:
            raise ValueError(f"sft round 0: no trajectories to train on in {[d.id for d in data]}")
        # A round whose exploration found no success has nothing to imitate: pass the policy on.
        return unchanged_checkpoint(
            w, store, policy, stage="sft", round=round, reason="no successful trajectories"
        )
    out = w.local_dir()
    num_params = sum(p.numel() for p in model.parameters())
    print(f"sft: round {round}, {len(examples)} trajectories from {', '.join(d.id for d in data)}")
    result = train(
        model, examples, loss="sft", cfg=train_config(cfg.sft, cfg.run.seed), out_dir=out, log=log
    )
    write_train_log(out, result.history)
    return write_checkpoint(
        w,
        model,
        tokenizer,
        policy="sft",
        round=round,
        parent=policy.id,
        base=policy.summary.get("base", ""),
        train_steps=result.steps,
        final_loss=result.final_loss,
        summary={"examples": len(examples), "train_time_s": result.train_time_s},
        save_model=False,
        num_params=num_params,
    )
