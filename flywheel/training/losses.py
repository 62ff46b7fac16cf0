"""The training losses (masked CE, DPO, GRPO and its MIX variant with expert NLL) and the ET-Agent efficiency reward, in pure torch.

Formulas are those of ALGORITHMS.md ("Expert SFT", "DPO", "GRPO"). Conventions shared by all:

- `logits` are [B, T, V] from a causal LM over `input_ids` [B, T]; position t predicts token t+1.
- `loss_mask` is [B, T], aligned with `input_ids`: 1 where token t is trained (assistant turns),
  0 for prompts, observations and padding. Functions taking logits shift it themselves.
- `grpo_loss` takes per-token tensors that are already aligned with each other ([B, L], the caller
  shifts), since the behaviour log-probs come from storage rather than from logits.

No DeepSpeed here; `pytest tests/flywheel/training/test_losses.py` checks each function against
numbers worked out by hand.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

Floats = Sequence[float] | torch.Tensor


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-prob of each next token: [B, T-1], entry t = log p(input_ids[t+1] | input_ids[:t+1]), float32."""
    logits = logits[:, :-1].float()
    targets = input_ids[:, 1:].unsqueeze(-1)
    # gather minus logsumexp avoids materialising a second [B, T, V] log_softmax tensor.
    picked = logits.gather(-1, targets).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def masked_ce(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """Mean cross-entropy over the trained tokens only; 0 (with grad) when no token is trained."""
    mask = loss_mask[:, 1:].float()
    nll = -token_logprobs(logits, input_ids)
    return (nll * mask).sum() / mask.sum().clamp(min=1.0)


def sequence_logprob(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """Per-sequence SUM of log-probs over the trained tokens: [B] (DPO sums, it does not average)."""
    return (token_logprobs(logits, input_ids) * loss_mask[:, 1:].float()).sum(-1)


class DPOOutput(NamedTuple):
    loss: torch.Tensor  # mean over the batch, with grad
    chosen_reward: torch.Tensor  # batch mean of beta * (pc - rc), detached
    rejected_reward: torch.Tensor  # batch mean of beta * (pr - rr), detached
    accuracy: torch.Tensor  # share of pairs whose chosen reward beats the rejected one


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> DPOOutput:
    """L = -log sigmoid(beta * [(pc - rc) - (pr - rr)]) over summed sequence log-probs [B]."""
    chosen = beta * (policy_chosen - ref_chosen)
    rejected = beta * (policy_rejected - ref_rejected)
    loss = -F.logsigmoid(chosen - rejected).mean()
    chosen, rejected = chosen.detach(), rejected.detach()
    accuracy = (chosen > rejected).float().mean()
    return DPOOutput(loss, chosen.mean(), rejected.mean(), accuracy)


def _group_index(group_ids: Sequence[Hashable] | torch.Tensor) -> torch.Tensor:
    """Map arbitrary group labels (task ids, ints) to 0..G-1, in order of first appearance."""
    if isinstance(group_ids, torch.Tensor):
        group_ids = group_ids.tolist()
    index: dict[Hashable, int] = {}
    return torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long)


def _group_stats(
    values: torch.Tensor, group_ids: Sequence[Hashable] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per item: its group's mean, unbiased std (0 for a group of one) and size."""
    index = _group_index(group_ids)
    if len(index) != len(values):
        raise ValueError(f"{len(values)} values but {len(index)} group ids")
    groups = int(index.max()) + 1 if len(index) else 0
    count = torch.zeros(groups, dtype=values.dtype).index_add_(0, index, torch.ones_like(values))
    mean = torch.zeros(groups, dtype=values.dtype).index_add_(0, index, values) / count
    squares = torch.zeros(groups, dtype=values.dtype).index_add_(
        0, index, (values - mean[index]) ** 2
    )
    std = (squares / (count - 1).clamp(min=1)).sqrt()
    return mean[index], std[index], count[index]


def group_advantages(rewards: Floats, group_ids: Sequence[Hashable] | torch.Tensor) -> torch.Tensor:
    """A = (R - mean_group) / (std_group + 1e-6), unbiased std; a group of one uses mean 0, std 1. float64."""
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    mean, std, count = _group_stats(rewards, group_ids)
    alone = count == 1
    mean = torch.where(alone, 0.0, mean)
    std = torch.where(alone, 1.0, std)
    return (rewards - mean) / (std + 1e-6)


class GRPOStats(NamedTuple):
    clip_fraction: torch.Tensor  # share of trained tokens where the clipped term was the one used
    ratio: torch.Tensor  # mean pi/pi_old over trained tokens
    kl: torch.Tensor  # mean 0.5*(logp - logp_ref)^2 over trained tokens (0 without a reference)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip: float = 0.2,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, GRPOStats]:
    """PPO clipped surrogate, token-mean over every trained token of the batch, plus optional KL.

    Per-token tensors are [B, L] and aligned; `advantages` is [B], broadcast to each trained token.
    """
    mask = loss_mask.bool()
    tokens = mask.sum().clamp(min=1)
    # Untrained positions hold arbitrary stored values (0); zero their log-ratio so exp() cannot
    # overflow into inf * 0 = nan.
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)
    ratio = log_ratio.exp()
    adv = advantages.to(ratio.dtype).unsqueeze(-1)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip, 1.0 + clip)
    per_token = torch.maximum(unclipped, clipped)
    loss = torch.where(mask, per_token, 0.0).sum() / tokens

    kl = torch.zeros((), dtype=loss.dtype, device=loss.device)
    if ref_logprobs is not None:
        diff = torch.where(mask, logprobs - ref_logprobs, 0.0)
        kl = (0.5 * diff**2).sum() / tokens
        loss = loss + kl_coef * kl
    clip_fraction = ((clipped > unclipped) & mask).sum() / tokens
    ratio_mean = torch.where(mask, ratio, 0.0).sum() / tokens
    return loss, GRPOStats(clip_fraction.detach(), ratio_mean.detach(), kl.detach())


def mix_loss(
    grpo_value: torch.Tensor,
    logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    expert: torch.Tensor,
    weight: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Trinity-RFT's MIX objective: ``(1 - weight) * grpo_value + weight * NLL``, where NLL is the
    token-mean negative log-prob over the trained tokens of the expert rows (``expert`` [B] is 1
    on them). ``grpo_value`` must already exclude the expert rows. A batch without expert rows
    adds an NLL of 0. Returns (loss, detached NLL)."""
    mask = loss_mask.bool() & expert.bool().unsqueeze(-1)
    nll = -torch.where(mask, logprobs, 0.0).sum() / mask.sum().clamp(min=1)
    return (1.0 - weight) * grpo_value + weight * nll, nll.detach()


def efficiency_reward(
    raw: Floats,
    tool_calls: Floats,
    lengths: Floats,
    group_ids: Sequence[Hashable] | torch.Tensor,
    format_ok: Sequence[bool] | torch.Tensor,
    s_tool: float = 0.2,
    s_len: float = 0.5,
) -> torch.Tensor:
    """ET-Agent reward R = raw * f_tool * f_len + f_format, per trajectory, float64.

    f_tool = 2 / (1 + exp(s_tool * (n - mean_group n))); f_len = 2 / (1 + exp(s_len * z)) with z the
    z-score of the length within its group (unbiased std, as for advantages; z = 0 when the std is 0);
    f_format = -1 when the trajectory broke the format, else 0.
    """
    raw = torch.as_tensor(raw, dtype=torch.float64)
    n = torch.as_tensor(tool_calls, dtype=torch.float64)
    length = torch.as_tensor(lengths, dtype=torch.float64)
    ok = torch.as_tensor(format_ok, dtype=torch.bool)
    n_mean, _, _ = _group_stats(n, group_ids)
    f_tool = 2.0 / (1.0 + torch.exp(s_tool * (n - n_mean)))
    len_mean, len_std, _ = _group_stats(length, group_ids)
    z = torch.where(len_std > 0, (length - len_mean) / len_std.clamp(min=1e-12), 0.0)
    f_len = 2.0 / (1.0 + torch.exp(s_len * z))
    f_format = torch.where(ok, 0.0, -1.0).to(torch.float64)
    return raw * f_tool * f_len + f_format


def anneal(value: float, step: int, total_steps: int) -> float:
    """Linear decay of `value` to 0 at `total_steps` (ET-Agent anneals s_tool and s_len this way)."""
    if total_steps <= 0:
        return 0.0
    return value * max(0.0, 1.0 - step / total_steps)
