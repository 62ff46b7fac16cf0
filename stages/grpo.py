"""Stage ``grpo``: group-relative policy optimisation on the pareto stage's selected groups
(ET-Agent, Trinity multi-step; ALGORITHMS.md, "GRPO").

Every trajectory of a group (the K rollouts of one task) gets the advantage
``(R - mean_group) / (std_group + 1e-6)``, broadcast to every token the policy sampled in it. The
loss is PPO's clipped ratio against the behaviour log-probs stored at rollout time: each turn's
``turn_logprobs`` are placed on the positions of its ``turn_token_ids`` in the encoded
conversation (those positions are exactly the loss mask; a trajectory where they disagree is an
error, never silently re-aligned). Groups whose rewards are all equal carry no signal and are
dropped (``drop_flat_groups``); a group of one is flat.

``efficiency_reward`` replaces R with ET-Agent's ``raw * f_tool * f_len + f_format`` (raw = the env
reward, n = valid tool calls (``tool_ok``), length = generated tokens, format broken = finish
reason invalid or error, or any invalid action). Its ``s_tool`` and ``s_len`` anneal linearly over
the flywheel rounds: round r uses ``s * (1 - (r - 1) / run.rounds)``, full strength in round 1.

``failure_credit: departure`` trains a below-average sample only up to its departure from the
better samples of its group: the tokens it shares with one of them cancel against it anyway (the
same token in the same context gets both advantages), and the tokens after its first wrong one
continue a trajectory that is already lost, so pushing them down punishes steps that were
reasonable in their context (docs/credit.md measures both on a real round).

``expert_weight`` > 0 turns on Trinity-RFT's MIX objective: ``(1 - w) * GRPO + w * NLL`` where the
NLL is the token mean over expert trajectories mixed into the batches. GRPO learns only from the
policy's own samples, so a task none of the K samples solved is a flat group and teaches nothing;
MIX takes the expert trajectories of exactly those tasks of this round's exploration (seeded
choice, ``expert_ratio`` of all trained trajectories at most). The stage then also reads the
explore and expert artifacts and lists them as inputs; with ``expert_weight`` 0 it reads neither.

``mix_source: own`` trains the NLL term on the policy's own successes instead (self-imitation):
the best successful sample of each solved task of the exploration the groups came from, chosen
as ``rft`` chooses (best Pareto rank, deduplicated), under the same cap. A task all K samples
solved is a flat group, so plain GRPO never trains its successes, where an SFT on the same
exploration (``rft``) imitates every one of them. The stage then reads the explore artifact only.

No groups left (none selected, or all flat): the stage warns and writes a checkpoint identical to
its input with ``skipped`` in the summary, as dpo does.

    flywheel stage grpo --round 1
"""

from __future__ import annotations

from functools import partial
from typing import Any

import polars as pl

from flywheel.checkpoint import (
    checkpoint_dir,
    load_policy,
    train_summary,
    unchanged_checkpoint,
    write_checkpoint,
    write_train_log,
)
from flywheel.config import Config, GrpoConfig
from flywheel.credit import cut_after_departure
from flywheel.progress import say
from flywheel.store import ArtifactRef, Store
from flywheel.training.launch import run_training
from flywheel.training.loop import LossParams
from flywheel.training.losses import anneal, efficiency_reward, group_advantages
from flywheel.trajectory import Trajectory
from stages._common import (
    start_validation,
    validation,
    validation_config,
    validation_inputs,
)
from stages.rft import select_successes

BROKEN_FORMAT = ("invalid", "error")


def sharpness(gc: GrpoConfig, round: int, rounds: int) -> tuple[float, float]:
    """(s_tool, s_len) of this round: full in round 1, then linearly less, 0 after run.rounds."""
    return anneal(gc.s_tool, round - 1, rounds), anneal(gc.s_len, round - 1, rounds)


def artifact_config(cfg: Config, round: int) -> dict[str, Any]:
    """What the artifact id hashes: the section, the seed, with the efficiency reward on the
    sharpness this round resolved (it depends on run.rounds), and what validation reads."""
    gc: GrpoConfig = cfg.grpo  # type: ignore[attr-defined]
    resolved = sharpness(gc, round, cfg.run.rounds) if gc.efficiency_reward else None
    return {
        "grpo": gc.artifact_dump(),
        "sharpness": resolved,
        "seed": cfg.train_seed,
        "validation": validation_config(cfg, gc),
    }


def rewards(frame: pl.DataFrame, gc: GrpoConfig, s_tool: float, s_len: float) -> list[float]:
    """The reward each trajectory is trained on: the env reward, or the efficiency reward."""
    raw = frame["reward"].fill_null(0.0).to_list()
    if not gc.efficiency_reward:
        return raw
    format_ok = [
        reason not in BROKEN_FORMAT and invalid == 0
        for reason, invalid in zip(frame["finish_reason"], frame["invalid_actions"], strict=True)
    ]
    shaped = efficiency_reward(
        raw, frame["tool_ok"].to_list(), frame["tokens"].to_list(), group_keys(frame),
        format_ok, s_tool=s_tool, s_len=s_len,
    )  # fmt: skip
    return shaped.tolist()


def group_keys(frame: pl.DataFrame) -> list[tuple[str, str]]:
    return list(zip(frame["env"].to_list(), frame["task_id"].to_list(), strict=True))


def trajectory_example(tokenizer: Any, row: dict[str, Any], advantage: float) -> dict[str, Any]:
    """A groups row -> the loop's grpo example: every sampled turn trained, on its stored ids,
    with its stored behaviour log-prob at the same position (0 elsewhere)."""
    ids, mask, old = Trajectory.from_row(row).encode_sampled(tokenizer)
    return {"input_ids": ids, "loss_mask": mask, "old_logprobs": old, "advantage": float(advantage)}


def departure_credit(
    examples: list[dict[str, Any]], keys: list[tuple[str, str]], train_rewards: list[float]
) -> tuple[list[dict[str, Any]], int]:
    """``failure_credit: departure``: each sample with a negative advantage keeps its loss mask
    only up to its departure from the samples of its group with a higher reward
    (``flywheel.credit.cut_after_departure``). Returns the examples and how many trained tokens
    were cleared."""
    by_group: dict[tuple[str, str], list[int]] = {}
    for i, key in enumerate(keys):
        by_group.setdefault(key, []).append(i)
    out, cleared = list(examples), 0
    for members in by_group.values():
        for i in members:
            if examples[i]["advantage"] >= 0:
                continue
            better = [
                examples[j]["input_ids"] for j in members if train_rewards[j] > train_rewards[i]
            ]
            mask = cut_after_departure(examples[i]["input_ids"], examples[i]["loss_mask"], better)
            cleared += sum(examples[i]["loss_mask"]) - sum(mask)
            out[i] = examples[i] | {"loss_mask": mask}
    return out, cleared


def unsolved_expert(
    explored: pl.DataFrame, expert: pl.DataFrame, n_policy: int, gc: GrpoConfig, seed: int
) -> pl.DataFrame:
    """MIX's expert rows: the successful expert trajectories of the explored tasks that no sample
    solved, at most ``expert_ratio / (1 - expert_ratio) * n_policy`` of them (a seeded choice)."""
    unsolved = (
        explored.group_by("env", "task_id")
        .agg(solved=pl.col("success").fill_null(False).any())
        .filter(~pl.col("solved"))
    )
    candidates = (
        expert.filter(pl.col("success").fill_null(False) & (pl.col("split") == "train"))
        .join(unsolved.select("env", "task_id"), on=["env", "task_id"], how="semi")
        .unique(["env", "task_id"], keep="first")
        .sort("env", "task_id")
    )
    return capped(candidates, n_policy, gc, seed)


def capped(candidates: pl.DataFrame, n_policy: int, gc: GrpoConfig, seed: int) -> pl.DataFrame:
    """MIX's cap: at most ``expert_ratio / (1 - expert_ratio) * n_policy`` rows (seeded choice)."""
    want = round(gc.expert_ratio / (1.0 - gc.expert_ratio) * n_policy)
    return candidates.sample(min(want, candidates.height), seed=seed, shuffle=True)


def own_successes(explored: pl.DataFrame, n_policy: int, gc: GrpoConfig, seed: int) -> pl.DataFrame:
    """MIX's rows with ``mix_source: own``: the best successful sample of each solved task
    (``rft``'s choice, one per task), at most ``expert_ratio / (1 - expert_ratio) * n_policy``
    of them (a seeded choice)."""
    return capped(select_successes(explored, per_task=1), n_policy, gc, seed)


def expert_example(tokenizer: Any, row: dict[str, Any]) -> dict[str, Any]:
    """A MIX row (an expert trajectory, or an own success) -> a grpo example trained by MIX's
    NLL term only (advantage 0, no behaviour log-probs: it is imitated, not reinforced)."""
    ids, mask = Trajectory.from_row(row).encode(tokenizer)
    if not any(mask):
        raise ValueError(f"grpo: MIX trajectory {row['env']}/{row['task_id']} has no trained turn")
    return {"input_ids": ids, "loss_mask": mask, "old_logprobs": [0.0] * len(ids), "advantage": 0.0,
            "expert": 1.0}  # fmt: skip


def prepare(
    frame: pl.DataFrame, gc: GrpoConfig, s_tool: float, s_len: float
) -> tuple[pl.DataFrame, dict[str, int]]:
    """Rewards and advantages per trajectory; flat groups dropped when asked. Returns the kept
    rows (with ``train_reward`` and ``advantage`` columns) and counts for the summary."""
    frame = frame.with_columns(
        train_reward=pl.Series(rewards(frame, gc, s_tool, s_len), dtype=pl.Float64)
    )
    spread = pl.col("train_reward").max().over("env", "task_id") - pl.col(
        "train_reward"
    ).min().over("env", "task_id")
    flat = frame.select(spread == 0).to_series()
    n_groups = frame.select(pl.struct("env", "task_id").n_unique()).item()
    flat_groups = frame.filter(flat).select(pl.struct("env", "task_id").n_unique()).item()
    if gc.drop_flat_groups:
        frame = frame.filter(~flat)
    advantages = group_advantages(frame["train_reward"].to_list(), group_keys(frame))
    frame = frame.with_columns(advantage=pl.Series(advantages.tolist(), dtype=pl.Float64))
    counts = {"groups_in": n_groups, "groups_flat": flat_groups}
    return frame, counts


def run(
    cfg: Config,
    store: Store,
    policy: ArtifactRef,
    groups: ArtifactRef,
    explored: ArtifactRef | None = None,
    expert: ArtifactRef | None = None,
    *,
    round: int,
    val_tasks: ArtifactRef | None = None,
    val_demos: ArtifactRef | None = None,
    log=None,
    force: bool = False,
) -> ArtifactRef:
    gc: GrpoConfig = cfg.grpo  # type: ignore[attr-defined]
    mix = gc.expert_weight > 0
    own = mix and gc.mix_source == "own"
    if own and explored is None:
        raise ValueError("grpo: expert_weight > 0 with mix_source own needs the round's explore")
    if mix and not own and (explored is None or expert is None):
        raise ValueError(
            "grpo: expert_weight > 0 needs the round's explore and the expert artifacts"
        )
    mix_inputs = [] if not mix else [explored.id] if own else [explored.id, expert.id]  # type: ignore[union-attr]
    w = store.writer(
        "checkpoints",
        stage="grpo",
        round=round,
        config=artifact_config(cfg, round),
        inputs=[policy.id, groups.id] + mix_inputs + validation_inputs(gc, val_tasks, val_demos),
        force=force,
    )
    if w.cached:
        return w.ref
    s_tool, s_len = sharpness(gc, round, cfg.run.rounds)
    frame = pl.from_arrow(store.read(groups))
    assert isinstance(frame, pl.DataFrame)
    if frame.is_empty():
        return unchanged_checkpoint(w, store, policy, stage="grpo", round=round, reason="no groups")
    frame, counts = prepare(frame, gc, s_tool, s_len)
    if frame.is_empty():
        return unchanged_checkpoint(
            w, store, policy, stage="grpo", round=round, reason="all groups flat"
        )
    behaviour = set(frame["policy"].unique().to_list())
    if behaviour != {policy.id}:
        # Legal (a curriculum stage starts from the previous stage's checkpoint), but the ratios
        # start away from 1 and PPO's clip does more of the work.
        say(
            f"grpo: note: groups were sampled by {sorted(behaviour)}, training starts from {policy.id}"
        )

    model, tokenizer = load_policy(store, policy)
    rows = frame.select(
        "env", "task_id", "sample_idx", "messages", "turn_token_ids", "turn_logprobs", "advantage"
    )
    examples = [
        trajectory_example(tokenizer, row, row["advantage"]) for row in rows.iter_rows(named=True)
    ]
    cut = 0
    if gc.failure_credit == "departure":
        examples, cut = departure_credit(
            examples, group_keys(frame), frame["train_reward"].to_list()
        )
    n_expert = 0
    if own:
        sampled = pl.from_arrow(store.read(explored))  # type: ignore[arg-type]
        assert isinstance(sampled, pl.DataFrame)
        gold = own_successes(sampled, len(examples), gc, cfg.train_seed)
    elif mix:
        # Only whether each explored task was solved matters, not its (large) token columns.
        solved = store.read(explored, columns=["env", "task_id", "success"])  # type: ignore[arg-type]
        gold = unsolved_expert(
            pl.from_arrow(solved), pl.from_arrow(store.read(expert)),  # type: ignore[arg-type]
            len(examples), gc, cfg.train_seed,
        )  # fmt: skip
    if mix:
        examples = [ex | {"expert": 0.0} for ex in examples]
        examples += [expert_example(tokenizer, row) for row in gold.iter_rows(named=True)]
        n_expert = gold.height
    params = LossParams(clip=gc.clip, kl_coef=gc.kl_coef, expert_weight=gc.expert_weight)
    out = w.local_dir()
    num_params = sum(p.numel() for p in model.parameters())
    used = counts["groups_in"] - (counts["groups_flat"] if gc.drop_flat_groups else 0)
    say(
        f"grpo: round {round}, {used} groups ({counts['groups_flat']} flat), {len(examples) - n_expert} "
        f"trajectories from {groups.id}"
        + (f", efficiency reward s_tool {s_tool:g} s_len {s_len:g}" if gc.efficiency_reward else "")
        + (
            f", MIX: {n_expert} "
            + ("own successes of solved tasks" if own else "expert trajectories of unsolved tasks")
            + f", weight {gc.expert_weight:g}"
            if mix
            else ""
        )
        + (
            f", departure credit: {cut} tokens of failures after their departure untrained"
            if gc.failure_credit == "departure"
            else ""
        )
    )
    start_key, known = start_validation(cfg, gc, store, policy, val_tasks, val_demos)
    result = run_training(
        model, examples, model_dir=checkpoint_dir(store, policy), loss="grpo", cfg=gc,
        seed=cfg.train_seed, params=params, out_dir=out, reference=gc.kl_coef > 0, log=log,
        log_every=cfg.run.log_every,
        validation=partial(validation, cfg, gc, store, tokenizer, val_tasks, val_demos),
        start_validation=known,
    )  # fmt: skip
    write_train_log(out, result.history)
    history = [h for h in result.history if "loss" in h]  # not the validation before step 1
    summary = {
        "groups": used,
        "groups_flat": counts["groups_flat"],
        "trajectories": len(examples) - n_expert,
        "mean_abs_advantage": float(frame["advantage"].abs().mean()),  # type: ignore[arg-type]
        "mean_reward": float(frame["train_reward"].mean()),  # type: ignore[arg-type]
        "clip_fraction": sum(h["clip_fraction"] for h in history) / len(history),
        "first_ratio": history[0]["ratio"],
        **train_summary(result, start_key),
    }
    if gc.efficiency_reward:
        summary |= {"s_tool": s_tool, "s_len": s_len}
    if gc.failure_credit == "departure":
        summary["tokens_after_departure"] = cut
    if mix:
        summary |= {
            ("own_trajectories" if own else "expert_trajectories"): n_expert,
            "expert_nll": sum(h["expert_nll"] for h in history) / len(history),
        }
    return write_checkpoint(
        w, model, tokenizer, policy="grpo", round=round, parent=policy.id,
        base=policy.summary.get("base", ""), train_steps=result.steps,
        final_loss=result.final_loss, summary=summary, save_model=False, num_params=num_params,
    )  # fmt: skip
