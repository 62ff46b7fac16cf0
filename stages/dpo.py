"""Stage ``dpo``: preference optimisation of the round's policy on the pareto stage's pairs (ETO).

Each pair is ``prompt + chosen`` against ``prompt + rejected``. The loss sums token log-probs over
the assistant turns of each continuation only: the prompt (instruction, ``Ok.``, first
observation) and every observation are masked; sampled turns are encoded from their stored ids,
expert turns from their text (ALGORITHMS.md, "DPO").

The reference is the policy at the start of the round. ``reference: precomputed`` (the default)
scores every pair with it once before training, keeps the numbers in memory and saves them as
``ref_logps.parquet`` next to the weights (the pairs artifact is an input and is never rewritten);
``reference: frozen`` keeps a frozen copy of the policy in memory and scores each batch with it.

beta and lr are lists indexed by round: round r uses entry r-1, the last entry for every later
round (defaults: beta 0.1 then 0.5, lr 1e-6 then 5e-7). The artifact id hashes the ``dpo``
section and the values the round resolved, so changing beta reruns dpo and what follows only.

No pairs (exploration found no task where a side beat the other): the stage warns and writes a
checkpoint identical to its input with ``skipped: "no pairs"`` in the summary, so the round still
evaluates and the next round explores again from the same policy.

    flywheel stage dpo --round 1
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from flywheel.checkpoint import (
    checkpoint_dir,
    load_policy,
    train_summary,
    unchanged_checkpoint,
    write_checkpoint,
    write_train_log,
)
from flywheel.config import Config, DpoConfig, TrainSection
from flywheel.progress import say
from flywheel.store import ArtifactRef, Store
from flywheel.training.launch import run_training
from flywheel.training.loop import LossParams, compute_ref_logps
from flywheel.trajectory import Trajectory
from stages._common import (
    start_validation,
    validation,
    validation_config,
    validation_inputs,
)

REF_LOGPS = "ref_logps.parquet"
REF_SCHEMA = pa.schema(
    [
        ("pair", pa.int64()),  # row index in the pairs artifact
        ("task_id", pa.string()),
        ("env", pa.string()),
        ("kind", pa.string()),
        ("chosen_sample_idx", pa.int32()),
        ("rejected_sample_idx", pa.int32()),
        ("ref_chosen_logp", pa.float64()),
        ("ref_rejected_logp", pa.float64()),
    ]
)


def per_round(values: list[float], round: int) -> float:
    """Entry ``round - 1`` of a per-round list; the last entry for every later round."""
    return values[min(max(round, 1), len(values)) - 1]


def artifact_config(cfg: Config, round: int) -> dict[str, Any]:
    """What the artifact id hashes: the section, the seed, the values this round resolved and
    what validation reads."""
    dc: DpoConfig = cfg.dpo  # type: ignore[attr-defined]
    return {
        "dpo": dc.artifact_dump(),
        "beta": per_round(dc.beta, round),
        "lr": per_round(dc.lr, round),
        "seed": cfg.train_seed,
        "validation": validation_config(cfg, dc),
    }


def train_section(dc: DpoConfig, round: int) -> TrainSection:
    """The training knobs of this round: the section with its per-round lr resolved."""
    knobs = dc.model_dump(include=set(TrainSection.model_fields)) | {"lr": per_round(dc.lr, round)}
    return TrainSection(**knobs)


def _side(tokenizer: Any, row: dict[str, Any], side: str) -> tuple[list[int], list[int]]:
    """``prompt + <side>`` of a pairs row, its stored ids on the side's generated turns; only
    the continuation's assistant turns are trained, whatever the stored flags say."""
    prompt = [{**m, "loss": False} for m in row["prompt"]]
    continuation = [{**m, "loss": m["role"] == "assistant"} for m in row[side]]
    return Trajectory(prompt + continuation, row[f"{side}_turn_token_ids"] or []).encode(tokenizer)


def pair_example(tokenizer: Any, row: dict[str, Any]) -> dict[str, list[int]]:
    """A pairs row -> the loop's dpo example (ids and loss mask of prompt+chosen, prompt+rejected)."""
    chosen_ids, chosen_mask = _side(tokenizer, row, "chosen")
    rejected_ids, rejected_mask = _side(tokenizer, row, "rejected")
    return {
        "chosen_ids": chosen_ids,
        "chosen_mask": chosen_mask,
        "rejected_ids": rejected_ids,
        "rejected_mask": rejected_mask,
    }


def last_epoch_mean(history: list[dict[str, Any]], key: str) -> float:
    """Mean of a per-step stat over the last epoch (the last step alone may hold a single pair)."""
    steps = [h for h in history if key in h]  # not the validation before the first step
    last = [h[key] for h in steps if h["epoch"] == steps[-1]["epoch"]]
    return float(sum(last) / len(last))


def _write_ref_logps(
    path: Path, pairs: pl.DataFrame, chosen: list[float], rejected: list[float]
) -> None:
    columns = {
        "pair": list(range(len(pairs))),
        **{
            c: pairs[c].to_list()
            for c in ("task_id", "env", "kind", "chosen_sample_idx", "rejected_sample_idx")
        },
        "ref_chosen_logp": chosen,
        "ref_rejected_logp": rejected,
    }
    pq.write_table(pa.Table.from_pydict(columns, schema=REF_SCHEMA), path)


def _reference_device() -> str:
    """This rank's accelerator ('cpu' on a CPU box), where the training will put the policy."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", "0")))


def run(
    cfg: Config,
    store: Store,
    policy: ArtifactRef,
    pairs: ArtifactRef,
    *,
    round: int,
    val_tasks: ArtifactRef | None = None,
    val_demos: ArtifactRef | None = None,
    log=None,
    force: bool = False,
) -> ArtifactRef:
    dc: DpoConfig = cfg.dpo  # type: ignore[attr-defined]
    w = store.writer(
        "checkpoints",
        stage="dpo",
        round=round,
        config=artifact_config(cfg, round),
        inputs=[policy.id, pairs.id, *validation_inputs(dc, val_tasks, val_demos)],
        force=force,
    )
    if w.cached:
        return w.ref
    frame = pl.from_arrow(store.read(pairs))
    assert isinstance(frame, pl.DataFrame)
    if frame.is_empty():
        return unchanged_checkpoint(w, store, policy, stage="dpo", round=round, reason="no pairs")

    model, tokenizer = load_policy(store, policy)
    rows = frame.select(
        "prompt", "chosen", "rejected", "chosen_turn_token_ids", "rejected_turn_token_ids"
    ).iter_rows(named=True)
    examples: list[dict[str, Any]] = [pair_example(tokenizer, row) for row in rows]
    tc = train_section(dc, round)
    params = LossParams(beta=per_round(dc.beta, round), nll_weight=dc.nll_weight)
    out = w.local_dir()
    if dc.reference == "precomputed":
        # On the device the training will use, truncated as the training will see the pairs.
        model.to(_reference_device())
        chosen, rejected = compute_ref_logps(
            model, examples, batch_size=tc.micro_batch_size, max_length=tc.max_length
        )
        examples = [
            ex | {"ref_chosen_logp": c, "ref_rejected_logp": r}
            for ex, c, r in zip(examples, chosen, rejected, strict=True)
        ]
        _write_ref_logps(out / REF_LOGPS, frame, chosen, rejected)

    num_params = sum(p.numel() for p in model.parameters())
    say(
        f"dpo: round {round}, {len(examples)} pairs from {pairs.id}, beta {params.beta}, lr {tc.lr:g}, "
        f"{dc.reference} reference"
    )
    start_key, known = start_validation(cfg, dc, store, policy, val_tasks, val_demos)
    result = run_training(
        model, examples, model_dir=checkpoint_dir(store, policy), loss="dpo", cfg=tc,
        seed=cfg.train_seed, params=params, out_dir=out, reference=dc.reference != "precomputed",
        log=log, log_every=cfg.run.log_every,
        validation=partial(validation, cfg, dc, store, tokenizer, val_tasks, val_demos),
        start_validation=known,
    )  # fmt: skip
    write_train_log(out, result.history)
    summary = {
        "pairs": len(examples),
        "beta": params.beta,
        "lr": tc.lr,
        "reward_accuracy": last_epoch_mean(result.history, "accuracy"),
        "chosen_reward": last_epoch_mean(result.history, "chosen_reward"),
        "rejected_reward": last_epoch_mean(result.history, "rejected_reward"),
        **train_summary(result, start_key),
    }
    summary["reward_margin"] = summary["chosen_reward"] - summary["rejected_reward"]
    return write_checkpoint(
        w, model, tokenizer, policy="dpo", round=round, parent=policy.id,
        base=policy.summary.get("base", ""), train_steps=result.steps,
        final_loss=result.final_loss, summary=summary, save_model=False, num_params=num_params,
    )  # fmt: skip
