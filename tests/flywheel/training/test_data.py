"""Example formats: validation, truncation, length-bucketed batches, collation."""

from __future__ import annotations

import random

import pytest
import torch

from flywheel.training.data import (
    collate,
    length_bucketed_batches,
    padding_share,
    truncate,
    validate,
)


def varied_lengths(n: int = 1000, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


@pytest.mark.parametrize(("n", "batch_size"), [(1, 4), (7, 3), (1000, 8), (1001, 16)])
def test_every_example_once_per_epoch(n: int, batch_size: int) -> None:
    lengths = varied_lengths(n)
    for epoch in range(3):
        batches = length_bucketed_batches(lengths, batch_size, seed=1, epoch=epoch)
        assert sorted(i for b in batches for i in b) == list(range(n))
        assert all(1 <= len(b) <= batch_size for b in batches)
        assert sum(len(b) < batch_size for b in batches) <= 1  # at most one partial batch


def test_padding_share_is_low_on_varied_lengths() -> None:
    lengths = varied_lengths()
    bucketed = length_bucketed_batches(lengths, 8, seed=0, epoch=0)
    order = list(range(len(lengths)))
    random.Random(0).shuffle(order)
    unsorted = [order[i : i + 8] for i in range(0, len(order), 8)]
    assert padding_share(bucketed, lengths) < 0.05
    assert padding_share(unsorted, lengths) > 0.3  # what plain shuffled batches would waste


def test_padding_share_by_hand() -> None:
    # Batch [5, 3]: 2 * 5 = 10 slots, 8 real; batch [4]: 4 slots, 4 real -> 2 / 14 padding.
    assert padding_share([[0, 1], [2]], [5, 3, 4]) == pytest.approx(2 / 14)


def test_batches_are_deterministic_by_seed_and_epoch() -> None:
    lengths = varied_lengths(200)
    first = length_bucketed_batches(lengths, 4, seed=3, epoch=0)
    assert first == length_bucketed_batches(lengths, 4, seed=3, epoch=0)
    assert first != length_bucketed_batches(lengths, 4, seed=3, epoch=1)
    assert first != length_bucketed_batches(lengths, 4, seed=4, epoch=0)


def test_truncation_keeps_the_start_of_aligned_fields() -> None:
    ex = {
        "input_ids": [1, 2, 3, 4, 5],
        "loss_mask": [0, 0, 1, 1, 1],
        "old_logprobs": [0, 0, -1, -2, -3],
        "advantage": 0.5,
    }
    out = truncate(ex, "grpo", 3)
    assert out == {
        "input_ids": [1, 2, 3],
        "loss_mask": [0, 0, 1],
        "old_logprobs": [0, 0, -1],
        "advantage": 0.5,
    }
    assert ex["input_ids"] == [1, 2, 3, 4, 5]  # the input is not modified
    pair = {
        "chosen_ids": [1, 2, 3],
        "chosen_mask": [0, 1, 1],
        "rejected_ids": [1, 9],
        "rejected_mask": [0, 1],
    }
    assert truncate(pair, "dpo", 2) == {
        "chosen_ids": [1, 2],
        "chosen_mask": [0, 1],
        "rejected_ids": [1, 9],
        "rejected_mask": [0, 1],
    }


def test_collate_sft_right_pads() -> None:
    batch = collate(
        [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}],
        "sft",
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]


def test_collate_dpo_shares_one_width() -> None:
    pair = {
        "chosen_ids": [1, 2, 3, 4],
        "chosen_mask": [0, 0, 1, 1],
        "rejected_ids": [1, 2],
        "rejected_mask": [0, 1],
    }
    batch = collate([pair | {"ref_chosen_logp": -3.0, "ref_rejected_logp": -1.5}], "dpo")
    assert batch["chosen_ids"].shape == batch["rejected_ids"].shape == (1, 4)
    assert batch["rejected_attention_mask"].tolist() == [[1, 1, 0, 0]]
    assert batch["ref_chosen_logp"].tolist() == [-3.0] and batch["ref_rejected_logp"].tolist() == [
        -1.5
    ]


def test_collate_grpo_float_fields() -> None:
    ex = {
        "input_ids": [1, 2, 3],
        "loss_mask": [0, 1, 1],
        "old_logprobs": [0.0, -0.5, -0.25],
        "advantage": -1.0,
    }
    batch = collate([ex, ex | {"input_ids": [4], "loss_mask": [0], "old_logprobs": [0.0]}], "grpo")
    assert batch["old_logprobs"].dtype == torch.float32
    assert batch["old_logprobs"].tolist() == [[0.0, -0.5, -0.25], [0.0, 0.0, 0.0]]
    assert batch["advantage"].tolist() == [-1.0, -1.0]
    assert "ref_logprobs" not in batch


def test_validate_gives_one_line_errors() -> None:
    with pytest.raises(ValueError, match="example 1: loss_mask has 2 entries but input_ids has 3"):
        validate(
            [{"input_ids": [1], "loss_mask": [1]}, {"input_ids": [1, 2, 3], "loss_mask": [1, 1]}],
            "sft",
        )
    with pytest.raises(ValueError, match=r"missing field\(s\) \['advantage'\]"):
        validate([{"input_ids": [1], "loss_mask": [1], "old_logprobs": [0.0]}], "grpo")
    pair = {"chosen_ids": [1], "chosen_mask": [1], "rejected_ids": [2], "rejected_mask": [1]}
    with pytest.raises(ValueError, match="ref_chosen_logp is set on 1 of 2"):
        validate([pair, pair | {"ref_chosen_logp": -1.0, "ref_rejected_logp": -2.0}], "dpo")
    with pytest.raises(ValueError, match="unknown example kind"):
        validate([pair], "ppo")  # type: ignore[arg-type]
