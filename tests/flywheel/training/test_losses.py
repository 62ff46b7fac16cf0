"""Each loss against numbers worked out by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from flywheel.training.losses import (
    anneal,
    dpo_loss,
    efficiency_reward,
    group_advantages,
    grpo_loss,
    masked_ce,
    mix_loss,
    sequence_logprob,
    token_logprobs,
)

LN3 = math.log(3.0)


def three_token_batch() -> tuple[torch.Tensor, torch.Tensor]:
    # Vocabulary of 2. Position 0 has logits [0, ln 3] -> p = [1/4, 3/4]; position 1 has [0, 0] ->
    # p = [1/2, 1/2]; position 2 predicts past the end and is never used.
    logits = torch.tensor([[[0.0, LN3], [0.0, 0.0], [5.0, -5.0]]], requires_grad=True)
    input_ids = torch.tensor([[0, 1, 0]])
    return logits, input_ids


def test_token_logprobs_are_shifted() -> None:
    logits, ids = three_token_batch()
    # Token 1 (= id 1) from position 0: ln 3/4; token 2 (= id 0) from position 1: ln 1/2.
    out = token_logprobs(logits, ids)
    assert out.dtype == torch.float32 and out.shape == (1, 2)
    assert out[0].tolist() == pytest.approx([math.log(0.75), math.log(0.5)], abs=1e-6)


def test_masked_ce_trains_only_masked_tokens() -> None:
    logits, ids = three_token_batch()
    # Only token 1 trained: CE = -ln 0.75 = 0.287682.
    loss = masked_ce(logits, ids, torch.tensor([[0, 1, 0]]))
    assert loss.item() == pytest.approx(0.287682, abs=1e-6)
    loss.backward()
    # Position 1 predicts the untrained token 2 (an "observation"): no gradient reaches it.
    assert torch.all(logits.grad[0, 1] == 0) and torch.any(logits.grad[0, 0] != 0)
    # Tokens 1 and 2 trained: (0.287682 + 0.693147) / 2 = 0.490415.
    both = masked_ce(logits, ids, torch.tensor([[0, 1, 1]]))
    assert both.item() == pytest.approx(0.490415, abs=1e-6)


def test_sequence_logprob_sums_trained_tokens() -> None:
    logits, ids = three_token_batch()
    # ln 0.75 + ln 0.5 = ln 0.375 = -0.980829 (a sum, not a mean).
    out = sequence_logprob(logits, ids, torch.tensor([[1, 1, 1]]))
    assert out.tolist() == pytest.approx([-0.980829], abs=1e-6)


def test_dpo_loss_by_hand() -> None:
    # beta 0.5. Pair 1: chosen reward 0.5*(-10 - -11) = 0.5, rejected 0.5*(-12 - -11) = -0.5,
    # margin 1 -> -log sigmoid(1) = log(1 + e^-1) = 0.313262.
    # Pair 2: chosen 0.5*(-5 - -5) = 0, rejected 0.5*(-4 - -5) = 0.5, margin -0.5
    # -> log(1 + e^0.5) = 0.974077. Mean 0.643669; accuracy 1/2.
    out = dpo_loss(
        policy_chosen=torch.tensor([-10.0, -5.0]),
        policy_rejected=torch.tensor([-12.0, -4.0]),
        ref_chosen=torch.tensor([-11.0, -5.0]),
        ref_rejected=torch.tensor([-11.0, -5.0]),
        beta=0.5,
    )
    assert out.loss.item() == pytest.approx(0.643669, abs=1e-6)
    assert out.chosen_reward.item() == pytest.approx((0.5 + 0.0) / 2)
    assert out.rejected_reward.item() == pytest.approx((-0.5 + 0.5) / 2)
    assert out.accuracy.item() == 0.5


def test_group_advantages_by_hand() -> None:
    # Group a = [1, 2, 3]: mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1 -> [-1, 0, 1] / (1 + 1e-6).
    # Group b = [5], alone: mean 0, std 1 -> 5 / (1 + 1e-6).
    # Group c = [0.5, 0.5]: std 0 -> 0 / 1e-6 = 0.
    rewards = [1.0, 5.0, 2.0, 0.5, 3.0, 0.5]
    groups = ["a", "b", "a", "c", "a", "c"]
    out = group_advantages(rewards, groups)
    expected = [-1 / (1 + 1e-6), 5 / (1 + 1e-6), 0.0, 0.0, 1 / (1 + 1e-6), 0.0]
    assert out.tolist() == pytest.approx(expected, abs=1e-9)


def test_group_advantages_unbiased_std() -> None:
    # [0, 1]: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = 0.707107 -> +-0.5 / 0.707108 = +-0.707106.
    out = group_advantages(torch.tensor([0.0, 1.0]), torch.tensor([7, 7]))
    assert out.tolist() == pytest.approx([-0.707106, 0.707106], abs=1e-6)


def test_grpo_clipping_cases() -> None:
    # One trained token per row (the second column is masked out), clip 0.2:
    # A=+1, ratio 1.5: min(1.5, 1.2) * A = 1.2 -> loss -1.2 (clipped: a push past 1+clip gains nothing)
    # A=+1, ratio 0.5: min(0.5, 0.8) = 0.5 -> -0.5 (not clipped)
    # A=-1, ratio 1.5: max(1.5, 1.2) = 1.5 -> +1.5 (not clipped: the bad token stays fully penalised)
    # A=-1, ratio 0.5: max(0.5, 0.8) = 0.8 -> +0.8 (clipped)
    # token mean = (-1.2 - 0.5 + 1.5 + 0.8) / 4 = 0.15; clip fraction 2/4; mean ratio (1.5+0.5+1.5+0.5)/4 = 1.
    old = torch.tensor([[-1.0, 0.0]] * 4)
    ratios = torch.tensor([1.5, 0.5, 1.5, 0.5])
    # The masked column holds a log-prob whose exp overflows: masking must keep it out (no nan).
    logprobs = torch.stack([-1.0 + ratios.log(), torch.full((4,), 1000.0)], dim=1).requires_grad_()
    mask = torch.tensor([[1, 0]] * 4)
    loss, stats = grpo_loss(logprobs, old, torch.tensor([1.0, 1.0, -1.0, -1.0]), mask, clip=0.2)
    assert loss.item() == pytest.approx(0.15, abs=1e-6)
    assert stats.clip_fraction.item() == 0.5 and stats.ratio.item() == pytest.approx(1.0)
    loss.backward()
    # Clipped rows get no gradient; d/dlogp of -A*ratio/4 is -A*ratio/4 on the others.
    assert logprobs.grad[:, 0].tolist() == pytest.approx([0.0, -0.5 / 4, 1.5 / 4, 0.0])
    assert torch.all(logprobs.grad[:, 1] == 0)


def test_grpo_token_mean_and_kl() -> None:
    # Row 0: 3 trained tokens, A=+1, ratio 1 -> -1 each; row 1: 1 trained token, A=-1 -> +1.
    # Token mean over the batch = (-3 + 1) / 4 = -0.5 (a mean of row means would give 0).
    # KL: logp - ref = 0.2 on one token, 0 elsewhere -> 0.5 * 0.04 / 4 = 0.005; coef 2 adds 0.01.
    logprobs = torch.zeros(2, 3)
    ref = torch.zeros(2, 3)
    ref[1, 0] = -0.2
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, stats = grpo_loss(
        logprobs, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask, ref_logprobs=ref, kl_coef=2.0
    )
    assert stats.kl.item() == pytest.approx(0.005, abs=1e-7)
    assert loss.item() == pytest.approx(-0.5 + 0.01, abs=1e-6)
    assert stats.clip_fraction.item() == 0.0


def test_mix_loss_by_hand() -> None:
    # Rows 0 and 2 are expert rows; row 1 is a policy row (its tokens belong to the GRPO term).
    # Expert trained tokens: row 0 log-probs -1 and -2 (third token masked), row 2 log-prob -3.
    # NLL = (1 + 2 + 3) / 3 = 2; weight 0.25: 0.75 * 0.4 + 0.25 * 2 = 0.8.
    logprobs = torch.tensor(
        [[-1.0, -2.0, -9.0], [-5.0, -5.0, -5.0], [-3.0, 0.0, 0.0]], requires_grad=True
    )
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    loss, nll = mix_loss(torch.tensor(0.4), logprobs, mask, torch.tensor([1.0, 0.0, 1.0]), 0.25)
    assert nll.item() == pytest.approx(2.0) and loss.item() == pytest.approx(0.8)
    loss.backward()
    # d/dlogp of -0.25 * sum / 3 on every trained expert token; nothing on the policy row.
    expected = [[-0.25 / 3, -0.25 / 3, 0.0], [0.0, 0.0, 0.0], [-0.25 / 3, 0.0, 0.0]]
    assert torch.allclose(logprobs.grad, torch.tensor(expected))
    # A batch without expert rows adds nothing.
    loss, nll = mix_loss(torch.tensor(0.4), logprobs, mask, torch.zeros(3), 0.25)
    assert nll.item() == 0.0 and loss.item() == pytest.approx(0.3)


def test_efficiency_reward_by_hand() -> None:
    # Group g: tool calls [1, 3, 2] (mean 2), lengths [10, 20, 30] (mean 20, unbiased std 10,
    # z = [-1, 0, 1]), raw [1, 1, 0], third trajectory broke the format.
    # f_tool: 2/(1+e^-0.2) = 1.099668, 2/(1+e^0.2) = 0.900332, 2/(1+e^0) = 1.
    # f_len: 2/(1+e^-0.5) = 1.244919, 1, 2/(1+e^0.5) = 0.755081.
    # R = [1 * 1.099668 * 1.244919, 1 * 0.900332 * 1, 0 * ... - 1] = [1.368997, 0.900332, -1].
    # Group h (one trajectory): n - mean = 0 and z = 0, so R = raw = 0.5.
    out = efficiency_reward(
        raw=[1.0, 1.0, 0.0, 0.5],
        tool_calls=[1, 3, 2, 4],
        lengths=[10, 20, 30, 99],
        group_ids=["g", "g", "g", "h"],
        format_ok=[True, True, False, True],
    )
    assert out.tolist() == pytest.approx([1.368997, 0.900332, -1.0, 0.5], abs=1e-6)


def test_efficiency_reward_equal_lengths_and_zero_scales() -> None:
    # Equal lengths: std 0 -> z = 0 -> f_len = 1. With s_tool = 0, f_tool = 2/(1+1) = 1: R = raw.
    out = efficiency_reward([0.3, 0.7], [1, 5], [8, 8], [0, 0], [True, True], s_tool=0.0)
    assert out.tolist() == pytest.approx([0.3, 0.7])


def test_anneal_is_linear_to_zero() -> None:
    # 0.2 at step 0, 0.2 * (1 - 5/10) = 0.1 halfway, 0 at and after the end.
    assert [anneal(0.2, s, 10) for s in (0, 5, 10, 12)] == pytest.approx([0.2, 0.1, 0.0, 0.0])
