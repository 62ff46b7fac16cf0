"""Checkpoint artifacts: a Hugging Face folder (model + tokenizer) plus one descriptive row.

Written by a training stage and read back by the next one:

    ref = write_checkpoint(writer, model, tokenizer, policy="sft", round=0, parent=init.id, ...)
    model, tokenizer = load_policy(store, ref)
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any

from data_contracts.checkpoints import REQUIRED_FILES
from flywheel.store import MANIFEST, ArtifactError, ArtifactRef, ArtifactWriter, Store

TRAIN_LOG = "train_log.jsonl"  # per-step training metrics next to the weights
WEIGHT_FILES = ("*.safetensors", "*.bin")


def weights_digest(folder: Path) -> str:
    """sha256 over a checkpoint folder's weight files (names and bytes, in name order). Two
    checkpoints with one digest hold the same weights: a training step that kept its start, or
    a round that passed its policy on, has its parent's digest."""
    digest = hashlib.sha256()
    for path in sorted({p for pattern in WEIGHT_FILES for p in folder.glob(pattern)}):
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def write_checkpoint(
    writer: ArtifactWriter,
    model: Any,
    tokenizer: Any,
    *,
    policy: str,
    round: int,
    parent: str,
    base: str,
    train_steps: int = 0,
    final_loss: float = math.nan,
    summary: dict[str, Any] | None = None,
    save_model: bool = True,
    num_params: int | None = None,
) -> ArtifactRef:
    """Save model and tokenizer into the writer's folder and commit the artifact.

    ``save_model=False`` when the training loop already wrote the model files there; pass
    ``num_params`` then too, since ZeRO-3 leaves the in-memory model partitioned."""
    out = writer.local_dir()
    if save_model:
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    row: dict[str, Any] = {
        "policy": policy,
        "round": round,
        "parent": parent,
        "base": base,
        "num_params": num_params
        if num_params is not None
        else sum(p.numel() for p in model.parameters()),
        "train_steps": train_steps,
        "final_loss": float(final_loss),
    }
    writer.write_shard(0, [row])
    info = {
        "policy": policy,
        "base": base,
        "num_params": row["num_params"],
        "train_steps": train_steps,
        # Every checkpoint says what it cost; train_summary() overrides this for a trained one,
        # so a step that passed its policy on (no pairs, no groups) counts 0 for sft_more.
        "train_tokens": 0,
        "weights_sha256": weights_digest(out),
    }
    if not math.isnan(row["final_loss"]):
        info["final_loss"] = row["final_loss"]
    return writer.commit(summary={**info, **(summary or {})}, extra={"policy": policy})


def train_summary(result: Any, start_key: str | None = None) -> dict[str, Any]:
    """A training run's numbers for the checkpoint's summary: wall time, tokens trained (what
    the compute-matched baseline sums), and with validation the step kept and why it stopped.
    With `start_key` (``stages._common.start_validation``), ``val_start`` records the validation
    of the starting weights under that key, for later runs from the same weights."""
    out: dict[str, Any] = {
        "train_time_s": result.train_time_s,
        "train_tokens": result.tokens,
        "stop_reason": result.stop_reason,
    }
    if result.lr_drop_steps:
        out["lr_drop_steps"] = list(result.lr_drop_steps)
    if result.best_step is not None:
        out |= {"best_step": result.best_step, "val_score": result.best_score}
        found = [
            h for h in result.history if h.get("step") == result.best_step and "val_score" in h
        ]
        for key, value in (found[0] if found else {}).items():
            if key.startswith("val_") and key != "val_score":
                out[key] = value
    start = [h for h in result.history if h.get("step") == 0 and "val_score" in h]
    if start_key is not None and start:
        numbers = {k: v for k, v in start[0].items() if k.startswith("val_") and k != "val_score"}
        out["val_start"] = {"key": start_key, "score": start[0]["val_score"], **numbers}
    return out


def checkpoint_dir(store: Store, ref: ArtifactRef) -> Path:
    if ref.kind != "checkpoints":
        raise ArtifactError(f"artifact {ref.id} is a {ref.kind} artifact, not a checkpoint")
    folder = store.local_path(ref)
    for name in REQUIRED_FILES:
        if not (folder / name).exists():
            raise ArtifactError(f"checkpoint {ref.id} at {folder} lacks {name}")
    return folder


def load_policy(store: Store, ref: ArtifactRef) -> tuple[Any, Any]:
    """Model (float32, eval mode, CPU) and tokenizer of a checkpoint artifact."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = checkpoint_dir(store, ref)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
    except (OSError, ValueError) as err:
        raise ArtifactError(
            f"checkpoint {ref.id} at {folder} cannot be loaded: {str(err).splitlines()[0]}"
        ) from None
    model.eval()
    return model, tokenizer


def write_train_log(folder: Path, history: list[dict[str, Any]]) -> None:
    """Per-step metrics next to the weights; the tracker logs them to MLflow as curves."""
    with open(folder / TRAIN_LOG, "w") as fh:
        for entry in history:
            fh.write(json.dumps(entry) + "\n")


def unchanged_checkpoint(
    w: ArtifactWriter, store: Store, policy: ArtifactRef, *, stage: str, round: int, reason: str
) -> ArtifactRef:
    """Commit a copy of ``policy`` (weights, config and tokenizer files) as this stage's output,
    with ``skipped: reason`` in the summary: a round without training data passes its policy on."""
    from transformers import AutoTokenizer

    print(
        f"{stage}: WARNING round {round}: {reason}; the policy {policy.id} is passed on unchanged",
        flush=True,
    )
    source, out = checkpoint_dir(store, policy), w.local_dir()
    for item in source.iterdir():
        # The parent's descriptive row, manifest and curves are its own, not this artifact's.
        if item.name in (MANIFEST, TRAIN_LOG) or item.suffix in (".parquet", ".png"):
            continue
        if item.is_dir():
            shutil.copytree(item, out / item.name, dirs_exist_ok=True)
        else:
            shutil.copy2(item, out / item.name)
    tokenizer = AutoTokenizer.from_pretrained(source)
    return write_checkpoint(
        w, None, tokenizer, policy=stage, round=round, parent=policy.id,
        base=policy.summary.get("base", ""), summary={"skipped": reason},
        save_model=False, num_params=policy.summary["num_params"],
    )  # fmt: skip
