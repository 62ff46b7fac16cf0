"""One training loop for the three losses (masked CE, DPO, GRPO) on DeepSpeed.

    result = train(model, examples, loss="sft", cfg=SftConfig(), seed=0, out_dir="ckpt/")

`cfg` is any training section of the config (`flywheel.config.TrainSection`: the one place the
training knobs and their defaults are defined); the loss's own numbers (DPO's beta, GRPO's clip,
...) come as `params=LossParams(...)`. `examples` are the dicts described in
`flywheel.training.data`.

Validation: with `cfg.val_every > 0` and a `validate(module) -> {"score": ..., ...}` callback
(higher is better), the loop validates before the first step and every `val_every` steps, keeps
the best weights in `out_dir/_best`, stops after `cfg.patience` validations without an
improvement of more than `cfg.min_delta`, and leaves the best weights in `out_dir`. With
`cfg.lr_drops > 0` a plateau does not stop training at first: the loop goes back to the best
weights, multiplies the learning rate by `cfg.lr_drop_factor`, starts the optimizer's moments
afresh and continues with fresh patience, up to `lr_drops` times (reduce-on-plateau with a
return to the best point: a constant-lr run stopped by validation is not yet the best its data
can give). A token
budget (`max_tokens`) stops training once that many tokens were trained (compute matching). The loop wraps the model in a
DeepSpeed engine (ZeRO stage from the config; gloo on CPU, the accelerator's backend elsewhere),
with a torch AdamW and a warmup + cosine LambdaLR, walks length-bucketed micro-batches, and saves a
Hugging Face folder (model only; the caller saves the tokenizer) to `out_dir`. With the sft loss,
`cfg.length_split` > 1 runs each micro-batch as that many length-sorted slices weighted by their
trained tokens (`length_slices`): the same gradient with less padding.

Single process: call `train()` directly; the rank/world/master variables are filled in when
missing. Several processes: the stages go through `flywheel.training.launch.run_training`, which
starts the DeepSpeed launcher when `cfg.world_size > 1`; a script of your own can be started with
`deepspeed --num_accelerators 2 script.py` (on CPU also set DS_ACCELERATOR=cpu). The ranks share
each optimizer step's `cfg.grad_accum` micro-batches (each runs grad_accum / world of them, taken
in turn from the same epoch order), so N ranks train on the same global batches as one and end
with the same weights within float rounding; only an epoch whose micro-batch count is not a
multiple of N differs, on its last step, where the list is padded by wrapping around. Rank 0
validates and broadcasts the result, so every rank stops at the same step.

Every `checkpoint_every` steps, and once `checkpoint_minutes` have passed since the last save
(15 by default: a killed step loses at most that much), the engine, optimizer, scheduler and data
position go to `out_dir/_train_state`; calling `train()` again with the same `out_dir` resumes
there and ends with the same parameters as an uninterrupted run (a save falls between steps, so
when it happens does not change what is trained). The train state is deleted once the final model is
saved. With ZeRO-3 the `model` object is left partitioned afterwards: load `out_dir` to use it.

Tests: `pytest tests/flywheel/training/test_loop.py` (the 2-rank launcher test is marked slow).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import os
import shutil
import socket
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from flywheel.config import TrainSection
from flywheel.progress import Progress
from flywheel.store import TRAIN_STATE_DIR, host_info
from flywheel.training import data, losses
from flywheel.training.prebuild import ensure_extensions_dir, without_shm_op

BEST_DIR = "_best"  # the best validated weights so far, an HF folder inside out_dir


@dataclass(frozen=True)
class LossParams:
    """The loss's own numbers; the stage passes the ones its loss reads (None: not used).

    dpo: beta (inverse temperature), nll_weight (+ w * token-mean NLL of the chosen side).
    grpo: clip (PPO ratio clip), kl_coef (weight of 0.5*(logp - logp_ref)^2), expert_weight (MIX).
    """

    beta: float | None = None
    nll_weight: float = 0.0
    clip: float | None = None
    kl_coef: float = 0.0
    expert_weight: float = 0.0

    def check(self, loss: str) -> None:
        needed = {"dpo": ("beta",), "grpo": ("clip",)}.get(loss, ())
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise ValueError(f"{loss} needs LossParams({', '.join(missing)}=...)")


@dataclass
class TrainResult:
    steps: int  # optimizer steps done, counting those before a resume
    final_loss: float
    # One dict per step: step, epoch, loss, lr, tokens and the loss's own stats; a step that
    # validated also carries the validation's numbers (val_score, ...).
    history: list[dict[str, float]]
    train_time_s: float  # wall time of this call
    tokens: int = 0  # tokens trained (attention-mask tokens of every micro-batch), all steps
    best_step: int | None = None  # the validated step whose weights were kept (None: the last)
    best_score: float | None = None
    stopped_early: bool = False  # patience ran out before the step cap
    stop_reason: str = "steps"  # steps | patience | tokens
    lr_drop_steps: list[int] = field(default_factory=list)  # steps where a plateau cut the lr


def train(
    model: torch.nn.Module,
    examples: Sequence[data.Example],
    *,
    loss: Literal["sft", "dpo", "grpo"],
    cfg: TrainSection,
    out_dir: str | Path,
    seed: int = 0,
    params: LossParams | None = None,
    ref_model: torch.nn.Module | None = None,
    log: Callable[[dict], None] | None = None,
    validate: Callable[[torch.nn.Module], dict[str, float]] | None = None,
    max_tokens: int | None = None,
    log_every: int = 0,
    start_validation: dict[str, float] | None = None,
    label: str | None = None,
) -> TrainResult:
    """Train `model` in place on `examples` with the given loss; save it as an HF folder in `out_dir`
    (the best validated weights when validating, else the last). `start_validation`: what
    `validate` returns for the starting weights, when the caller already knows it (another run
    validated the same weights the same way); the validation before the first step is then not
    run again. `label` names the run in its progress lines (`[train rft] ...`; the loss by
    default)."""
    start = time.perf_counter()
    out_dir = Path(out_dir)
    params = params or LossParams()
    params.check(loss)
    data.validate(examples, loss)
    examples = [data.truncate(ex, loss, cfg.max_length) for ex in examples]
    _check_reference(examples, loss, params, model, ref_model)
    validating = validate is not None and cfg.val_every > 0
    if validating and cfg.zero_stage == 3:
        raise ValueError(
            "validation during training needs zero_stage <= 2 (ZeRO-3 partitions the weights)"
        )
    rank, world = init_distributed()
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    lengths = [data.example_length(ex, loss) for ex in examples]
    split = getattr(cfg, "length_split", 1)  # the sft-loss sections have it (SftLossSection)
    if split > 1 and loss != "sft":
        raise ValueError(f"length_split applies to the sft loss only, not {loss}")
    accum = _rank_accum(cfg, world)
    steps_per_epoch = math.ceil(len(_local_batches(lengths, cfg, seed, 0, rank, world)) / accum)
    total = cfg.epochs * steps_per_epoch
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)

    torch.manual_seed(seed)
    on_cpu = get_accelerator().device_name() == "cpu"
    autocast = cpu_autocast(cfg, on_cpu)
    optimizer = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(total, cfg))
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=deepspeed_config(cfg, world, bf16=cfg.bf16 and not on_cpu),
    )
    if ref_model is not None:
        ref_model.to(device=engine.device, dtype=next(engine.module.parameters()).dtype)
        ref_model.eval().requires_grad_(False)

    state_dir = out_dir / TRAIN_STATE_DIR  # read by `flywheel artifacts ls` and `resumed`
    fingerprint = _fingerprint(cfg, seed, params, loss, lengths, world, max_tokens)
    st = _load_state(engine, state_dir, fingerprint)
    step, epoch, batch_index, history = st.step, st.epoch, st.batch_index, st.history
    tag = label or loss
    bar = Progress(f"[train {tag}]", total, unit="steps", done=step, enabled=rank == 0)
    if step:
        bar.note(f"[train {tag}] resumed at step {step}/{total} from {state_dir}")

    def check(at: int, record: dict[str, float], known: dict[str, float] | None = None) -> None:
        """Validate now (or take `known`, the numbers of these weights); keep the weights when
        they beat the best by more than min_delta."""
        assert validate is not None
        if known is not None:
            found = dict(known)
        else:
            found = _validate(engine.module, validate) if rank == 0 else {}
        if world > 1 and known is None:
            # Rank 0's numbers decide for every rank: a rank that stopped alone would hang the rest.
            box = [found]
            dist.broadcast_object_list(box, src=0)
            found = box[0]
        record.update({f"val_{k}" if k == "score" else k: v for k, v in found.items()})
        if st.best_score is None or found["score"] > st.best_score + cfg.min_delta:
            st.best_score, st.best_step, st.bad = found["score"], at, 0
            _save_hf(engine, out_dir / BEST_DIR, cfg.zero_stage)
        else:
            st.bad += 1
        line = "  ".join(f"{k} {v:.4f}" for k, v in found.items() if k != "score")
        bar.note(
            f"[train {tag}] validate step {at}: {line} (best step {st.best_step}, "
            f"{st.bad}/{cfg.patience} without improvement)"
            + (" (known: the same weights were validated the same way before)" if known else "")
        )

    try:
        if validating and st.best_score is None:
            first: dict[str, float] = {"step": 0}
            check(0, first, start_validation)
            st.validations.append(first)

        engine.train()
        every = log_every or max(1, total // 20)
        saved_at = time.monotonic()
        window_tokens, window_start = 0, time.perf_counter()
        local, local_epoch = [], -1
        reason = "steps"
        while step < total:
            if max_tokens is not None and st.tokens >= max_tokens:
                reason = "tokens"
                break
            if validating and st.bad >= cfg.patience:
                if len(st.drops) >= cfg.lr_drops:
                    reason = "patience"
                    break
                old = scheduler.get_last_lr()[0]
                _restart_from_best(engine, scheduler, out_dir / BEST_DIR, cfg.lr_drop_factor)
                st.drops.append(step)
                st.bad = 0
                bar.note(
                    f"[train {tag}] plateau at step {step}: back to step {st.best_step}, "
                    f"lr {old:.2e} -> {scheduler.get_last_lr()[0]:.2e} "
                    f"(drop {len(st.drops)}/{cfg.lr_drops})"
                )
            if local_epoch != epoch:
                local, local_epoch = _local_batches(lengths, cfg, seed, epoch, rank, world), epoch
            group = local[batch_index : batch_index + accum]
            lr = scheduler.get_last_lr()[0]
            micro_batches = [[examples[i] for i in b] for b in group]
            record = _train_step(engine, micro_batches, loss, params, ref_model, split, autocast)
            step += 1
            st.tokens += int(record["tokens"])
            record.update(step=step, epoch=epoch, lr=lr)
            batch_index += len(group)
            if batch_index >= len(local):
                epoch, batch_index = epoch + 1, 0
            out_of_tokens = max_tokens is not None and st.tokens >= max_tokens
            if validating and (step % cfg.val_every == 0 or step == total or out_of_tokens):
                check(step, record)  # the last step is always validated, whatever ends the run
            history.append(record)
            # With lr drops a plateau reloads the best weights, which live outside the train
            # state: saving right after each improvement keeps a resumed run from reloading
            # weights that a lost step wrote after the saved state.
            improved = validating and cfg.lr_drops > 0 and st.best_step == step
            due = _checkpoint_due(cfg, step, time.monotonic() - saved_at, world)
            if step < total and (due or (improved and _checkpointing(cfg))):
                st.step, st.epoch, st.batch_index = step, epoch, batch_index
                _save_state(engine, state_dir, fingerprint, st)
                saved_at = time.monotonic()
            window_tokens += int(record["tokens"])
            bar.update(1, tokens=int(record["tokens"]), loss=record["loss"])
            if step % every == 0 or step == total:
                speed = window_tokens / max(time.perf_counter() - window_start, 1e-9)
                line = (
                    f"step {step}/{total} loss {record['loss']:.4f} lr {lr:.2e} {speed:.0f} tok/s"
                )
                bar.line(f"[train {tag}] {line}, {bar.rate()}, {bar.eta()}")
                window_tokens, window_start = 0, time.perf_counter()
            if log is not None:
                log(record)
    finally:
        bar.close()  # on a TTY the bar keeps its own line, also when a step fails

    if reason == "steps" and max_tokens is not None and st.tokens >= max_tokens:
        reason = "tokens"  # the budget ran out on the last step
    if validating:
        bar.note(
            f"[train {tag}] kept step {st.best_step} (val score {st.best_score:.4f}); "
            f"stopped at step {step}/{total} ({reason})"
        )
        dist.barrier()
        if rank == 0:
            _adopt_best(out_dir)
    else:
        _save_hf(engine, out_dir, cfg.zero_stage)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(state_dir, ignore_errors=True)
    final = history[-1]["loss"] if history else float("nan")
    return TrainResult(
        step, final, st.validations + history, time.perf_counter() - start, tokens=st.tokens,
        best_step=st.best_step if validating else None,
        best_score=st.best_score if validating else None,
        stopped_early=reason == "patience", stop_reason=reason, lr_drop_steps=list(st.drops),
    )  # fmt: skip


def _restart_from_best(engine: Any, scheduler: Any, best_dir: Path, factor: float) -> None:
    """Load the best validated weights (rank 0 saved them to `best_dir`) into every rank's
    module and the optimizer's fp32 copies, clear the optimizer's moments and scale the
    learning rate by `factor` from the next step on."""
    from safetensors.torch import load_file

    dist.barrier()  # rank 0 wrote best_dir
    module = engine.module
    saved = load_file(str(best_dir / "model.safetensors"))
    missing, unexpected = module.load_state_dict(saved, strict=False)
    # save_pretrained leaves out tied copies (the lm head tied to the embeddings): those alone
    # may be missing, and only when the module really ties them.
    tied = {name for name, p in module.named_parameters(remove_duplicate=False)} - {
        name for name, _ in module.named_parameters()
    }
    if unexpected or set(missing) - tied:
        raise RuntimeError(
            f"{best_dir} does not match the model being trained "
            f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )
    optimizer = engine.optimizer
    if hasattr(optimizer, "refresh_fp32_params"):
        optimizer.refresh_fp32_params()  # ZeRO / mixed precision keep fp32 master weights
    inner = getattr(optimizer, "optimizer", optimizer)
    inner.state.clear()
    scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
    for group in scheduler.optimizer.param_groups:
        group["lr"] *= factor
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def _validate(
    module: torch.nn.Module, validate: Callable[[torch.nn.Module], dict[str, float]]
) -> dict[str, float]:
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            found = dict(validate(module))
    finally:
        module.train(was_training)
    if "score" not in found or not math.isfinite(found["score"]):
        raise ValueError(f"validate() must return a finite 'score', got {found}")
    return found


def _adopt_best(out_dir: Path) -> None:
    """Move the best validated weights from out_dir/_best into out_dir."""
    best = out_dir / BEST_DIR
    for item in best.iterdir():
        target = out_dir / item.name
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(item, target)
    best.rmdir()


def validation_loss(
    model: torch.nn.Module, examples: Sequence[data.Example], *, batch_size: int, max_length: int
) -> float:
    """Token-mean masked CE of sft examples under `model` (no gradients): the val loss."""
    data.validate(examples, "sft")
    examples = [data.truncate(ex, "sft", max_length) for ex in examples]
    device = next(model.parameters()).device
    order = sorted(range(len(examples)), key=lambda i: -data.example_length(examples[i], "sft"))
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            batch = data.collate([examples[i] for i in order[start : start + batch_size]], "sft")
            batch = {k: v.to(device) for k, v in batch.items()}
            logits = _logits(model, batch["input_ids"], batch["attention_mask"])
            n = int(batch["loss_mask"][:, 1:].sum())
            total += float(losses.masked_ce(logits, batch["input_ids"], batch["loss_mask"])) * n
            count += n
    return total / max(count, 1)


def _train_step(
    engine: Any,
    micro_batches: list[list[data.Example]],
    kind: data.Kind,
    params: LossParams,
    ref_model: Any,
    length_split: int = 1,
    autocast: bool = False,
) -> dict:
    """Forward/backward every micro-batch of one optimizer step (each in `length_split` slices,
    see `length_slices`; the forward passes under CPU bf16 autocast when `autocast`), then step;
    return the step's numbers."""
    totals: dict[str, float] = {}
    # Tokens trained: every real token of the step's sequences (their attention masks), counted
    # from the examples so that a pass repeated at weight 0 (length_slices) adds none.
    tokens = sum(len(ex[seq]) for mb in micro_batches for ex in mb for seq in data.SEQUENCES[kind])
    passes = [
        (piece, weight / len(micro_batches))
        for examples in micro_batches
        for piece, weight in length_slices(examples, kind, length_split)
    ]
    for i, (examples, weight) in enumerate(passes):
        # The last step of an epoch may hold fewer micro-batches than grad_accum: the boundary is
        # set by hand and the loss scaled by the real count, not by DeepSpeed's fixed one.
        engine.set_gradient_accumulation_boundary(i == len(passes) - 1)
        batch = {k: v.to(engine.device) for k, v in data.collate(examples, kind).items()}
        # The losses take float32 log-probs of the logits (losses.token_logprobs) either way.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            value, stats = _batch_loss(engine, batch, kind, params, ref_model)
        engine.backward(value * weight, scale_wrt_gas=False)
        engine.step()
        for name, v in {"loss": value.detach(), **stats}.items():
            totals[name] = totals.get(name, 0.0) + float(v) * weight
    if dist.get_world_size() > 1:
        # Report the mean loss and total tokens over ranks; other stats stay those of this rank.
        summed = torch.tensor([totals["loss"], float(tokens)], dtype=torch.float64)
        dist.all_reduce(summed)
        totals["loss"], tokens = summed[0].item() / dist.get_world_size(), int(summed[1].item())
    return totals | {"tokens": tokens}


def cpu_autocast(cfg: TrainSection, on_cpu: bool) -> bool:
    """Whether training forward passes run under bf16 autocast: `cpu_bf16` on a CPU run. Refused
    on a CPU without bf16 instructions, where torch emulates bf16 and it is slower than float32;
    on an accelerator `bf16` decides instead."""
    if not (cfg.cpu_bf16 and on_cpu):
        return False
    host = host_info()
    if not {"avx512_bf16", "amx_bf16"} & set(host["cpu_flags"]):
        raise ValueError(
            f"cpu_bf16: this CPU ({host['cpu'] or 'unknown'}) has neither avx512_bf16 nor "
            "amx_bf16, so bf16 would be emulated and slower than float32; set cpu_bf16: false"
        )
    return True


def length_slices(
    examples: list[data.Example], kind: data.Kind, split: int
) -> list[tuple[list[data.Example], float]]:
    """One micro-batch as `split` slices of similar length, each with the weight that makes the
    weighted sum of the slices' losses the micro-batch's loss.

    The masked CE is a mean over the trained tokens, so a slice's weight is its share of them: the
    gradient equals the whole micro-batch's (to float rounding), while each slice is padded only
    to its own longest sequence. There are always `split` slices, so the ranks of a multi-rank run
    take as many backward passes a step (ZeRO-2 reduces the gradients in each one): where a
    micro-batch holds fewer examples than that (an epoch's last), a slice repeats its longest
    example at weight 0. Only the sft loss splits this way (DPO's is a mean over pairs plus a
    token mean, GRPO's has its own normalisers); `split` 1 is the micro-batch as it is.
    """
    if split <= 1:
        return [(examples, 1.0)]
    if kind != "sft":
        raise ValueError(f"length_split applies to the sft loss only, not {kind}")
    ordered = sorted(examples, key=lambda ex: data.example_length(ex, kind))
    cuts = [k * len(ordered) // split for k in range(split + 1)]
    slices = [ordered[a:b] for a, b in itertools.pairwise(cuts)]
    trained = [sum(sum(ex["loss_mask"][1:]) for ex in piece) for piece in slices]
    total = sum(trained)
    return [
        (piece or ordered[-1:], t / total if total else 0.0)
        for piece, t in zip(slices, trained, strict=True)
    ]


def _batch_loss(
    model: Any, batch: dict[str, torch.Tensor], kind: data.Kind, cfg: LossParams, ref_model: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one collated batch under `model` (an engine or a plain module), and its stats."""
    if kind == "sft":
        logits = _logits(model, batch["input_ids"], batch["attention_mask"])
        return losses.masked_ce(logits, batch["input_ids"], batch["loss_mask"]), {}
    if kind == "dpo":
        # Chosen and rejected share one padded width (data.collate), so one forward covers both.
        ids = torch.cat([batch["chosen_ids"], batch["rejected_ids"]])
        attention = torch.cat([batch["chosen_attention_mask"], batch["rejected_attention_mask"]])
        mask = torch.cat([batch["chosen_mask"], batch["rejected_mask"]])
        logits = _logits(model, ids, attention)
        policy = losses.sequence_logprob(logits, ids, mask)
        if "ref_chosen_logp" in batch:
            ref = torch.cat([batch["ref_chosen_logp"], batch["ref_rejected_logp"]])
        else:
            with torch.no_grad():
                ref = losses.sequence_logprob(_logits(ref_model, ids, attention), ids, mask)
        (policy_chosen, policy_rejected), (ref_chosen, ref_rejected) = policy.chunk(2), ref.chunk(2)
        assert cfg.beta is not None
        out = losses.dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, cfg.beta)
        stats = {k: v for k, v in out._asdict().items() if k != "loss"}
        if cfg.nll_weight <= 0:
            return out.loss, stats
        # Pure DPO can lower the chosen side's likelihood too, as long as the rejected side
        # falls faster; on small policies that collapses generation. The NLL term holds it up.
        n = batch["chosen_ids"].shape[0]
        nll = losses.masked_ce(logits[:n], ids[:n], mask[:n])
        return out.loss + cfg.nll_weight * nll, stats | {"chosen_nll": nll.detach()}
    if kind == "grpo":
        ids, attention = batch["input_ids"], batch["attention_mask"]
        logprobs = losses.token_logprobs(_logits(model, ids, attention), ids)
        ref_tokens = batch["ref_logprobs"][:, 1:] if "ref_logprobs" in batch else None
        if ref_tokens is None and ref_model is not None and cfg.kl_coef > 0:
            with torch.no_grad():
                ref_tokens = losses.token_logprobs(_logits(ref_model, ids, attention), ids)
        # Stored per-token fields are aligned with input_ids; logprobs start at token 1.
        mask = batch["loss_mask"][:, 1:]
        expert = batch.get("expert")
        assert cfg.clip is not None
        policy_mask = mask if expert is None else mask * (1 - expert.to(mask.dtype)).unsqueeze(-1)
        value, grpo_stats = losses.grpo_loss(
            logprobs, batch["old_logprobs"][:, 1:], batch["advantage"], policy_mask,
            clip=cfg.clip, ref_logprobs=ref_tokens, kl_coef=cfg.kl_coef,
        )  # fmt: skip
        if expert is None:
            return value, grpo_stats._asdict()
        value, nll = losses.mix_loss(value, logprobs, mask, expert, cfg.expert_weight)
        return value, grpo_stats._asdict() | {"expert_nll": nll}
    raise ValueError(f"unknown loss {kind!r}; expected sft, dpo or grpo")


def compute_ref_logps(
    model: torch.nn.Module,
    examples: Sequence[data.Example],
    batch_size: int = 8,
    max_length: int | None = None,
) -> tuple[list[float], list[float]]:
    """Reference log-probs (summed over trained tokens) of each DPO pair: (chosen, rejected) lists.

    Pass the training run's max_length so the sums cover the tokens the training will see.
    """
    data.validate(examples, "dpo")
    if max_length is not None:
        examples = [data.truncate(ex, "dpo", max_length) for ex in examples]
    device = next(model.parameters()).device
    # Longest first, in order of length, so batches pad little; results go back to input order.
    order = sorted(range(len(examples)), key=lambda i: -data.example_length(examples[i], "dpo"))
    chosen, rejected = [0.0] * len(examples), [0.0] * len(examples)
    was_training = model.training
    model.eval()
    with torch.no_grad(), Progress("[dpo reference]", len(order), unit="pairs") as bar:
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            batch = {
                k: v.to(device) for k, v in data.collate([examples[i] for i in idx], "dpo").items()
            }
            for seq, out in (("chosen", chosen), ("rejected", rejected)):
                ids, mask = batch[f"{seq}_ids"], batch[f"{seq}_mask"]
                logits = _logits(model, ids, batch[f"{seq}_attention_mask"])
                for i, value in zip(
                    idx, losses.sequence_logprob(logits, ids, mask).tolist(), strict=True
                ):
                    out[i] = value
            tokens = sum(int(batch[f"{s}_attention_mask"].sum()) for s in ("chosen", "rejected"))
            bar.update(len(idx), tokens=tokens)
    model.train(was_training)
    return chosen, rejected


def init_distributed() -> tuple[int, int]:
    """Join (or create) the process group; fills single-process env defaults. Returns (rank, world size)."""
    ensure_extensions_dir()
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    # DeepSpeed 0.19's ZeRO calls these torch collectives, deprecated in torch 2.13, on every
    # step; the warning is not ours to act on and would bury the progress lines.
    warnings.filterwarnings(
        "ignore",
        r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`",
        FutureWarning,
    )
    if not dist.is_initialized():
        single = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
        for key, value in single.items():
            os.environ.setdefault(key, value)
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(_free_port())
        accelerator = get_accelerator()
        on_cpu = accelerator.device_name() == "cpu"
        backend = "gloo" if on_cpu else accelerator.communication_backend_name()
        if os.environ["WORLD_SIZE"] == "1":
            # One process: an in-memory rendezvous store, so no TCPStore listens on every
            # interface (torch's default binds [::]:MASTER_PORT); DeepSpeed then reuses the group,
            # without its shared-memory op (an all-reduce between processes: 30-60 s of g++ for
            # nothing in a fresh environment).
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            with without_shm_op() if on_cpu else contextlib.nullcontext():
                deepspeed.init_distributed(dist_backend=backend, verbose=False)
        else:
            deepspeed.init_distributed(dist_backend=backend, verbose=False)
    return dist.get_rank(), dist.get_world_size()


def deepspeed_config(cfg: TrainSection, world_size: int, bf16: bool) -> dict[str, Any]:
    """The DeepSpeed config for `cfg`: built from its fields, or its template with 'auto' filled in."""
    if cfg.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {cfg.zero_stage}")
    accum = _rank_accum(cfg, world_size)
    base = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": accum,
        "train_batch_size": cfg.micro_batch_size * accum * world_size,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        "steps_per_print": 2**31 - 1,  # the loop prints its own progress
    }
    path = cfg.deepspeed_template()
    if path is None:
        return base
    if not path.is_file():
        raise ValueError(f"deepspeed_config: no such file {cfg.deepspeed_config}")
    template = json.loads(path.read_text())
    filled = _fill_auto(template, base, str(path))
    stage = filled.get("zero_optimization", {}).get("stage")
    if stage != cfg.zero_stage:
        raise ValueError(
            f"{cfg.deepspeed_config} sets ZeRO stage {stage} but zero_stage is {cfg.zero_stage}"
        )
    return filled


def _rank_accum(cfg: TrainSection, world: int) -> int:
    """Micro-batches each rank runs per optimizer step: its share of cfg.grad_accum."""
    if cfg.grad_accum % world:
        raise ValueError(
            f"grad_accum ({cfg.grad_accum}) must be a multiple of the rank count ({world}): "
            "the ranks share each step's micro-batches"
        )
    return cfg.grad_accum // world


def _save_hf(engine: Any, out_dir: Path, zero_stage: int) -> None:
    """Save the engine's module with save_pretrained on rank 0, gathering ZeRO-3 partitions first."""
    module = engine.module
    rank = dist.get_rank()
    if zero_stage != 3:
        if rank == 0:
            module.save_pretrained(out_dir)
        return
    import deepspeed

    state = module.state_dict() if rank == 0 else {}
    gathered: dict[int, torch.Tensor] = {}
    # One parameter at a time so no rank ever holds the whole model; tied weights share one copy.
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) not in gathered:
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                gathered[id(param)] = (
                    param.data.detach().cpu().clone() if rank == 0 else torch.empty(0)
                )
        if rank == 0:
            state[name] = gathered[id(param)]
    if rank == 0:
        module.save_pretrained(out_dir, state_dict=state)


def _logits(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def _check_reference(
    examples: Sequence[data.Example], kind: str, cfg: LossParams, model: Any, ref_model: Any
) -> None:
    precomputed = {"dpo": "ref_chosen_logp", "grpo": "ref_logprobs"}.get(kind)
    needs_ref = kind == "dpo" or (kind == "grpo" and cfg.kl_coef > 0)
    if needs_ref and precomputed not in examples[0] and ref_model is None:
        raise ValueError(f"{kind} needs {precomputed} on the examples or a ref_model")
    if kind == "grpo" and cfg.expert_weight <= 0 and any(ex.get("expert") for ex in examples):
        raise ValueError(
            "grpo examples include expert rows but expert_weight is 0: they would not be trained"
        )
    if ref_model is not None and ref_model is model:
        raise ValueError("ref_model must be a frozen copy of the policy, not the policy itself")


def _local_batches(
    lengths: list[int], cfg: TrainSection, seed: int, epoch: int, rank: int, world: int
) -> list[list[int]]:
    """This rank's micro-batches of an epoch. With several ranks the batch list is padded by
    wrapping around (as torch's DistributedSampler does) so every rank takes the same number of
    steps: ZeRO's collectives would hang otherwise."""
    batches = data.length_bucketed_batches(
        lengths, cfg.micro_batch_size, seed=seed, epoch=epoch, chunk_batches=cfg.bucket_batches
    )
    for i in range((-len(batches)) % world):
        batches.append(batches[i])
    return batches[rank::world]


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    # Decay matrices only: biases and norm gains are 1-D and decaying them only hurts.
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def _lr_lambda(total: int, cfg: TrainSection) -> Callable[[int], float]:
    warmup = math.ceil(cfg.warmup_ratio * total)

    def factor(step: int) -> float:
        # (step + 1) / (warmup + 1): the first step already learns, the last warmup step is below peak.
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if cfg.schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


@dataclass
class _State:
    """Where a training run is: what a resumable train state saves and restores."""

    step: int = 0
    epoch: int = 0
    batch_index: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    tokens: int = 0
    best_score: float | None = None
    best_step: int | None = None
    bad: int = 0  # validations since the last improvement
    drops: list[int] = field(default_factory=list)  # steps where a plateau cut the lr
    validations: list[dict[str, float]] = field(default_factory=list)  # the one before step 1


def _checkpointing(cfg: TrainSection) -> bool:
    return bool(cfg.checkpoint_every or cfg.checkpoint_minutes)


def _checkpoint_due(cfg: TrainSection, step: int, since_save_s: float, world: int) -> bool:
    """Whether to save the train state after `step`: every `checkpoint_every` steps, and once
    `checkpoint_minutes` have passed since the last save. Rank 0's clock decides for every rank
    (the save is collective, and the ranks' clocks differ by a little)."""
    if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
        return True
    if not cfg.checkpoint_minutes:
        return False
    due = since_save_s >= 60.0 * cfg.checkpoint_minutes
    if world > 1:
        box = [due]
        dist.broadcast_object_list(box, src=0)
        due = bool(box[0])
    return due


def _save_state(engine: Any, state_dir: Path, fingerprint: str, st: _State) -> None:
    """Save a resumable train state, then drop older ones (DeepSpeed writes 'latest' only after a
    complete save, so a crash mid-save still resumes from the previous state)."""
    tag = f"step{st.step}"
    client = dataclasses.asdict(st)
    client |= {"torch_rng": torch.get_rng_state(), "fingerprint": fingerprint}
    engine.save_checkpoint(str(state_dir), tag=tag, client_state=client)
    dist.barrier()
    if dist.get_rank() == 0:
        for old in state_dir.iterdir():
            if old.is_dir() and old.name != tag:
                shutil.rmtree(old, ignore_errors=True)


def _load_state(engine: Any, state_dir: Path, fingerprint: str) -> _State:
    """The latest train state, or the start of training."""
    if not (state_dir / "latest").exists():
        return _State()
    _, client = engine.load_checkpoint(str(state_dir))
    if client["fingerprint"] != fingerprint:
        raise ValueError(
            f"{state_dir} holds the train state of a different run; delete it to start over"
        )
    torch.set_rng_state(client["torch_rng"])
    return _State(**{f.name: client[f.name] for f in dataclasses.fields(_State)})


def _fingerprint(
    cfg: TrainSection,
    seed: int,
    params: LossParams,
    kind: str,
    lengths: list[int],
    world: int,
    max_tokens: int | None,
) -> str:
    # Everything that changes which parameters a step produces; not the checkpoint cadence.
    knobs = cfg.result_dump()
    blob = json.dumps(
        [knobs, seed, dataclasses.asdict(params), kind, lengths, world, max_tokens], sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _fill_auto(template: dict[str, Any], base: dict[str, Any], source: str) -> dict[str, Any]:
    out = dict(base)
    for key, value in template.items():
        if value == "auto":
            if key not in base:
                raise ValueError(f"{source}: no value to fill for 'auto' key {key!r}")
            out[key] = base[key]
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            out[key] = _fill_auto(value, base[key], source)
        else:
            out[key] = value
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
