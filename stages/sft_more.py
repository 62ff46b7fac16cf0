"""Stage ``sft_more`` (a baseline): the bootstrap SFT policy trained further on the expert
data, with the compute the flywheel's rounds used.

The question it answers: is a round's gain more than what the same compute spent on plain SFT
would buy? The budget is summed from the manifests of the rounds' training checkpoints
(``train_tokens``, or ``train_steps`` with ``sft_more.match: steps``); training starts from the
round-0 SFT policy, on the same expert trajectories (train split), and stops at the budget.
With ``sft_more.val_every`` it keeps the best validated checkpoint, as the rounds may.

    flywheel stage sft_more --round 2      # after the last round (baselines: [sft_more])
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

from flywheel.checkpoint import (
    checkpoint_dir,
    load_policy,
    train_summary,
    unchanged_checkpoint,
    write_checkpoint,
    write_train_log,
)
from flywheel.config import Config
from flywheel.progress import say
from flywheel.store import ArtifactRef, Store
from flywheel.training.launch import run_training
from stages._common import (
    start_validation,
    validation,
    validation_config,
    validation_inputs,
)
from stages.sft import examples_from


def artifact_config(cfg: Config) -> dict[str, Any]:
    """What the artifact id hashes: the sft_more section, the seed and what validation reads
    (the budget comes from the rounds' checkpoints, which are inputs)."""
    return {
        "sft_more": cfg.sft_more.artifact_dump(),
        "seed": cfg.baseline_seed(cfg.sft_more),
        "validation": validation_config(cfg, cfg.sft_more),
    }


def budget(rounds: list[ArtifactRef], match: str) -> int:
    """Tokens (or optimizer steps) the rounds' training checkpoints used, from their manifests."""
    key = "train_tokens" if match == "tokens" else "train_steps"
    missing = [ref.id for ref in rounds if key not in ref.summary]
    if missing:
        raise ValueError(f"sft_more: checkpoints {missing} do not record {key}")
    return int(sum(ref.summary[key] for ref in rounds))


def run(
    cfg: Config,
    store: Store,
    policy: ArtifactRef,
    expert: ArtifactRef,
    rounds: list[ArtifactRef],
    *,
    round: int,
    val_tasks: ArtifactRef | None = None,
    val_demos: ArtifactRef | None = None,
    log=None,
    force: bool = False,
) -> ArtifactRef:
    sc = cfg.sft_more
    w = store.writer(
        "checkpoints",
        stage="sft_more",
        round=round,
        config=artifact_config(cfg),
        inputs=[
            policy.id,
            expert.id,
            *(r.id for r in rounds),
            *validation_inputs(sc, val_tasks, val_demos),
        ],
        force=force,
    )
    if w.cached:
        return w.ref
    if not rounds:
        raise ValueError("sft_more: no round checkpoints to match the compute of (run.rounds >= 1)")
    target = budget(rounds, sc.match)
    model, tokenizer = load_policy(store, policy)
    examples = examples_from(store, [expert], tokenizer)
    if not examples:
        # Envs without an oracle or imported data: "more SFT" has nothing to train on, so the
        # baseline is the bootstrap policy itself.
        return unchanged_checkpoint(
            w, store, policy, stage="sft_more", round=round, reason="no demonstrations to train on"
        )
    # Enough epochs to reach the budget; the budget, not the epochs, ends the training.
    if sc.match == "tokens":
        per_epoch = sum(min(len(ex["input_ids"]), sc.max_length) for ex in examples)
        section = sc.model_copy(update={"epochs": math.ceil(target / per_epoch) + 1})
        max_tokens: int | None = target
    else:
        batches = math.ceil(len(examples) / sc.micro_batch_size)
        steps_per_epoch = max(1, math.ceil(batches / sc.grad_accum))
        epochs = max(1, math.ceil(target / steps_per_epoch))
        section = sc.model_copy(update={"epochs": epochs, "max_steps": target})
        max_tokens = None
    out = w.local_dir()
    num_params = sum(p.numel() for p in model.parameters())
    say(
        f"sft_more: {len(examples)} expert trajectories, budget {target} {sc.match} "
        f"(the rounds' {', '.join(r.id for r in rounds)})"
    )
    start_key, known = start_validation(cfg, sc, store, policy, val_tasks, val_demos)
    result = run_training(
        model, examples, model_dir=checkpoint_dir(store, policy), loss="sft", cfg=section,
        seed=cfg.baseline_seed(cfg.sft_more), out_dir=out, log=log, max_tokens=max_tokens,
        log_every=cfg.run.log_every,
        validation=partial(validation, cfg, sc, store, tokenizer, val_tasks, val_demos),
        start_validation=known, label="sft_more",
    )  # fmt: skip
    write_train_log(out, result.history)
    return write_checkpoint(
        w, model, tokenizer, policy="sft_more", round=round, parent=policy.id,
        base=policy.summary.get("base", ""), train_steps=result.steps,
        final_loss=result.final_loss,
        summary={"examples": len(examples), "budget": target, "match": sc.match,
                 **train_summary(result, start_key)},
        save_model=False, num_params=num_params,
    )  # fmt: skip
