"""Training examples: their formats, truncation, length-bucketed batching and collation to tensors.

The sft, dpo and grpo stages turn trajectories into plain dicts of python lists, one per example:

| kind | field | type | meaning |
|---|---|---|---|
| sft  | input_ids | list[int] | the whole conversation, tokenized |
| sft  | loss_mask | list[int] | 1 where token t is trained (assistant turns), aligned with input_ids |
| dpo  | chosen_ids, chosen_mask | list[int] | prompt + preferred continuation, and its loss mask |
| dpo  | rejected_ids, rejected_mask | list[int] | prompt + dispreferred continuation, and its loss mask |
| dpo  | ref_chosen_logp, ref_rejected_logp | float, optional | reference log-probs summed over trained tokens |
| grpo | input_ids, loss_mask | list[int] | as for sft |
| grpo | old_logprobs | list[float] | log-prob of token t under the behaviour policy at index t; 0 where loss_mask is 0 |
| grpo | advantage | float | the trajectory's group advantage, broadcast to its trained tokens |
| grpo | ref_logprobs | list[float], optional | as old_logprobs, under the reference policy |
| grpo | expert | float, optional | 1 on an expert trajectory (MIX: trained by NLL, not by the GRPO term), else 0 |

Truncation keeps the START of every sequence (the task prompt and the first turns) and drops the
tail: a later assistant turn is lost rather than the instruction it answers. Precomputed reference
log-probs must be computed on the same truncation (`loop.compute_ref_logps` does).

Batching sorts examples by length inside shuffled chunks, so a batch holds similar lengths and
padding stays a small share of the tokens, while the order still changes from epoch to epoch. It is
a pure function of (seed, epoch), which is what lets an interrupted run resume on the same batches.
Padding is on the right. Run the tests with `pytest tests/flywheel/training/test_data.py`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Literal

import torch

Kind = Literal["sft", "dpo", "grpo"]
Example = dict[str, Any]

# Token sequences of each kind; each has fields aligned with it token for token.
SEQUENCES: dict[str, tuple[str, ...]] = {
    "sft": ("input_ids",),
    "dpo": ("chosen_ids", "rejected_ids"),
    "grpo": ("input_ids",),
}
ALIGNED: dict[str, tuple[str, ...]] = {
    "input_ids": ("loss_mask", "old_logprobs", "ref_logprobs"),
    "chosen_ids": ("chosen_mask",),
    "rejected_ids": ("rejected_mask",),
}
ATTENTION = {
    "input_ids": "attention_mask",
    "chosen_ids": "chosen_attention_mask",
    "rejected_ids": "rejected_attention_mask",
}
REQUIRED: dict[str, tuple[str, ...]] = {
    "sft": ("input_ids", "loss_mask"),
    "dpo": ("chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask"),
    "grpo": ("input_ids", "loss_mask", "old_logprobs", "advantage"),
}
OPTIONAL: dict[str, tuple[str, ...]] = {
    "sft": (),
    "dpo": ("ref_chosen_logp", "ref_rejected_logp"),
    "grpo": ("ref_logprobs", "expert"),
}
FLOAT_TOKENS = {"old_logprobs", "ref_logprobs"}
SCALARS = {"advantage", "ref_chosen_logp", "ref_rejected_logp", "expert"}


def validate(examples: Sequence[Example], kind: Kind) -> None:
    """Raise a one-line ValueError on the first malformed example (missing field, misaligned lengths)."""
    if kind not in REQUIRED:
        raise ValueError(f"unknown example kind {kind!r}; expected one of {sorted(REQUIRED)}")
    if not examples:
        raise ValueError(f"no {kind} examples to train on")
    for i, ex in enumerate(examples):
        missing = [f for f in REQUIRED[kind] if f not in ex]
        if missing:
            raise ValueError(f"{kind} example {i}: missing field(s) {missing}")
        for seq in SEQUENCES[kind]:
            if len(ex[seq]) == 0:
                raise ValueError(f"{kind} example {i}: {seq} is empty")
            for field in ALIGNED[seq]:
                if field in ex and len(ex[field]) != len(ex[seq]):
                    raise ValueError(
                        f"{kind} example {i}: {field} has {len(ex[field])} entries but {seq} has {len(ex[seq])}"
                    )
    for field in OPTIONAL[kind]:
        present = sum(field in ex for ex in examples)
        if 0 < present < len(examples):
            raise ValueError(
                f"{kind} examples: {field} is set on {present} of {len(examples)}; set it on all or none"
            )


def example_length(example: Example, kind: Kind) -> int:
    """Tokens the example occupies in a batch: its longest sequence (dpo pads chosen and rejected together)."""
    return max(len(example[seq]) for seq in SEQUENCES[kind])


def truncate(example: Example, kind: Kind, max_length: int) -> Example:
    """Cut every sequence and its aligned fields to `max_length` tokens, keeping the start."""
    out = dict(example)
    for seq in SEQUENCES[kind]:
        for field in (seq, *ALIGNED[seq]):
            if field in out:
                out[field] = out[field][:max_length]
    return out


def length_bucketed_batches(
    lengths: Sequence[int], batch_size: int, *, seed: int, epoch: int, chunk_batches: int = 50
) -> list[list[int]]:
    """Batches of example indices: every index exactly once, similar lengths together, order by (seed, epoch).

    Indices are shuffled, cut into chunks of `chunk_batches * batch_size`, sorted by length inside
    each chunk and cut into batches; then the batches themselves are shuffled, so long and short
    batches alternate through the epoch instead of following the chunk order.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    chunk = batch_size * chunk_batches
    batches = []
    for start in range(0, len(order), chunk):
        # Sorting longest first puts the one partial batch of the last chunk among the short ones.
        part = sorted(order[start : start + chunk], key=lambda i: -lengths[i])
        batches += [part[b : b + batch_size] for b in range(0, len(part), batch_size)]
    rng.shuffle(batches)
    return batches


def padding_share(batches: Sequence[Sequence[int]], lengths: Sequence[int]) -> float:
    """Share of the tokens in the padded batches that are padding (0.0 = none)."""
    total = sum(max(lengths[i] for i in b) * len(b) for b in batches if b)
    real = sum(lengths[i] for b in batches for i in b)
    return 1.0 - real / total if total else 0.0


def collate(examples: Sequence[Example], kind: Kind) -> dict[str, torch.Tensor]:
    """Right-pad a batch to its longest sequence and stack it into tensors.

    Each sequence gets an attention mask (`attention_mask`, or `chosen_attention_mask` and
    `rejected_attention_mask` for dpo); padding has loss mask 0 and log-prob 0. The two dpo
    sequences share one padded length so the loop can run them through the model as one batch.
    """
    width = max(example_length(ex, kind) for ex in examples)
    batch: dict[str, torch.Tensor] = {}
    for seq in SEQUENCES[kind]:
        batch[seq] = _pad([ex[seq] for ex in examples], width, torch.long)
        batch[ATTENTION[seq]] = _pad([[1] * len(ex[seq]) for ex in examples], width, torch.long)
        for field in ALIGNED[seq]:
            if field in examples[0]:
                dtype = torch.float32 if field in FLOAT_TOKENS else torch.long
                batch[field] = _pad([ex[field] for ex in examples], width, dtype)
    for field in SCALARS:
        if field in examples[0]:
            batch[field] = torch.tensor([float(ex[field]) for ex in examples], dtype=torch.float32)
    return batch


def _pad(rows: Sequence[Sequence[float]], width: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row, dtype=dtype)
    return out
