"""One training loop for the three losses (masked CE, DPO, GRPO) on DeepSpeed.

    result = train(model, examples, loss="sft", cfg=TrainConfig(), out_dir="ckpt/")

`examples` are the dicts described in `flywheel.training.data`. The loop wraps the model in a
DeepSpeed engine (ZeRO stage from the config; gloo on CPU, the accelerator's backend elsewhere),
with a torch AdamW and a warmup + cosine LambdaLR, walks length-bucketed micro-batches, and saves a
Hugging Face folder (model only; the caller saves the tokenizer) to `out_dir`.

Single process: call `train()` directly; the rank/world/master variables are filled in when
missing. Several processes: start the calling script with the DeepSpeed launcher, e.g.
`deepspeed --num_accelerators 2 script.py` (on CPU also set DS_ACCELERATOR=cpu); every rank reads
its own slice of each epoch's batches.

Every `checkpoint_every` steps the engine, optimizer, scheduler and data position go to
`out_dir/_train_state`; calling `train()` again with the same `out_dir` resumes there and ends with
the same parameters as an uninterrupted run. The train state is deleted once the final model is
saved. With ZeRO-3 the `model` object is left partitioned afterwards: load `out_dir` to use it.

Tests: `pytest tests/flywheel/training/test_loop.py` (the 2-rank launcher test is marked slow).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import socket
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from flywheel.training import data, losses
from flywheel.training.prebuild import ensure_extensions_dir

STATE_DIR = "_train_state"


@dataclass
class TrainConfig:
    """Knobs of one training run; defaults are the 7B-scale values of ALGORITHMS.md where given.

    A plain dataclass: the config system maps its pydantic section (with the help texts) onto it.
    """

    epochs: int = 3  # passes over the examples
    lr: float = 2e-5  # peak learning rate (AdamW)
    warmup_ratio: float = 0.03  # share of the steps spent warming up linearly
    schedule: Literal["cosine", "constant"] = "cosine"  # LR shape after warmup (cosine ends at 0)
    micro_batch_size: int = 4  # examples per forward pass, per rank
    grad_accum: int = 1  # micro-batches per optimizer step, per rank
    max_length: int = 4096  # tokens kept per sequence; the start is kept
    zero_stage: int = 2  # DeepSpeed ZeRO stage: 0, 1, 2 or 3
    seed: int = 0  # seeds the batch order and torch's RNG
    checkpoint_every: int = 0  # optimizer steps between resumable train states; 0 = none
    max_steps: int | None = None  # cap on optimizer steps; the LR schedule ends there
    beta: float = 0.1  # DPO inverse temperature
    nll_weight: float = 0.0  # DPO: + this * token-mean NLL of the chosen side (keeps it likely)
    clip: float = 0.2  # GRPO ratio clip
    kl_coef: float = 0.0  # GRPO weight of 0.5*(logp - logp_ref)^2
    expert_weight: float = 0.0  # GRPO MIX: weight of the expert rows' NLL (1 - w on GRPO)
    weight_decay: float = 0.0  # AdamW weight decay, on matrices only
    grad_clip: float = 1.0  # max global gradient norm; 0 = off
    bf16: bool = True  # bf16 weights and compute on an accelerator; always off on CPU
    deepspeed_config: str | None = None  # JSON template; its "auto" values come from here
    # Batches sorted by length together. Sorting makes batches alike: on the arith SFT data a
    # chunk of 4 or 50 batches left the loss at 1.1 after 150 steps where a plain shuffle (1)
    # reached 0.56, so bucketing is opt-in for data whose lengths vary a lot.
    bucket_batches: int = 1
    log_every: int = 0  # steps between progress lines; 0 = about 20 lines per run


@dataclass
class TrainResult:
    steps: int  # optimizer steps done, counting those before a resume
    final_loss: float
    # One dict per step: step, epoch, loss, lr, tokens and the loss's own stats.
    history: list[dict[str, float]]
    train_time_s: float  # wall time of this call


def train(
    model: torch.nn.Module,
    examples: Sequence[data.Example],
    *,
    loss: Literal["sft", "dpo", "grpo"],
    cfg: TrainConfig,
    out_dir: str | Path,
    ref_model: torch.nn.Module | None = None,
    log: Callable[[dict], None] | None = None,
) -> TrainResult:
    """Train `model` in place on `examples` with the given loss; save it as an HF folder in `out_dir`."""
    start = time.perf_counter()
    out_dir = Path(out_dir)
    data.validate(examples, loss)
    examples = [data.truncate(ex, loss, cfg.max_length) for ex in examples]
    _check_reference(examples, loss, cfg, model, ref_model)
    rank, world = init_distributed()
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    lengths = [data.example_length(ex, loss) for ex in examples]
    steps_per_epoch = math.ceil(len(_local_batches(lengths, cfg, 0, rank, world)) / cfg.grad_accum)
    total = cfg.epochs * steps_per_epoch
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)

    torch.manual_seed(cfg.seed)
    on_cpu = get_accelerator().device_name() == "cpu"
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

    state_dir = out_dir / STATE_DIR
    fingerprint = _fingerprint(cfg, loss, lengths, world)
    step, epoch, batch_index, history = _load_state(engine, state_dir, fingerprint)
    if step and rank == 0:
        print(f"[train {loss}] resumed at step {step}/{total} from {state_dir}", flush=True)

    engine.train()
    every = cfg.log_every or max(1, total // 20)
    window_tokens, window_start = 0, time.perf_counter()
    local, local_epoch = [], -1
    while step < total:
        if local_epoch != epoch:
            local, local_epoch = _local_batches(lengths, cfg, epoch, rank, world), epoch
        group = local[batch_index : batch_index + cfg.grad_accum]
        lr = scheduler.get_last_lr()[0]
        micro_batches = [[examples[i] for i in b] for b in group]
        record = _train_step(engine, micro_batches, loss, cfg, ref_model)
        step += 1
        record.update(step=step, epoch=epoch, lr=lr)
        batch_index += len(group)
        if batch_index >= len(local):
            epoch, batch_index = epoch + 1, 0
        history.append(record)
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < total:
            _save_state(engine, state_dir, fingerprint, step, epoch, batch_index, history)
        window_tokens += int(record["tokens"])
        if rank == 0 and (step % every == 0 or step == total):
            speed = window_tokens / max(time.perf_counter() - window_start, 1e-9)
            line = f"step {step}/{total} loss {record['loss']:.4f} lr {lr:.2e} {speed:.0f} tok/s"
            print(f"[train {loss}] {line}", flush=True)
            window_tokens, window_start = 0, time.perf_counter()
        if log is not None:
            log(record)

    _save_hf(engine, out_dir, cfg.zero_stage)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(state_dir, ignore_errors=True)
    final = history[-1]["loss"] if history else float("nan")
    return TrainResult(step, final, history, time.perf_counter() - start)


def _train_step(
    engine: Any,
    micro_batches: list[list[data.Example]],
    kind: data.Kind,
    cfg: TrainConfig,
    ref_model: Any,
) -> dict:
    """Forward/backward every micro-batch of one optimizer step, then step; return the step's numbers."""
    totals: dict[str, float] = {}
    tokens = 0
    for i, examples in enumerate(micro_batches):
        # The last step of an epoch may hold fewer micro-batches than grad_accum: the boundary is
        # set by hand and the loss scaled by the real count, not by DeepSpeed's fixed one.
        engine.set_gradient_accumulation_boundary(i == len(micro_batches) - 1)
        batch = {k: v.to(engine.device) for k, v in data.collate(examples, kind).items()}
        value, stats = _batch_loss(engine, batch, kind, cfg, ref_model)
        engine.backward(value / len(micro_batches), scale_wrt_gas=False)
        engine.step()
        for name, v in {"loss": value.detach(), **stats}.items():
            totals[name] = totals.get(name, 0.0) + float(v) / len(micro_batches)
        tokens += int(sum(v.sum() for k, v in batch.items() if k.endswith("attention_mask")))
    if dist.get_world_size() > 1:
        # Report the mean loss and total tokens over ranks; other stats stay those of this rank.
        summed = torch.tensor([totals["loss"], float(tokens)], dtype=torch.float64)
        dist.all_reduce(summed)
        totals["loss"], tokens = summed[0].item() / dist.get_world_size(), int(summed[1].item())
    return totals | {"tokens": tokens}


def _batch_loss(
    model: Any, batch: dict[str, torch.Tensor], kind: data.Kind, cfg: TrainConfig, ref_model: Any
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
    with torch.no_grad():
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
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
    return dist.get_rank(), dist.get_world_size()


def deepspeed_config(cfg: TrainConfig, world_size: int, bf16: bool) -> dict[str, Any]:
    """The DeepSpeed config for `cfg`: built from its fields, or its template with 'auto' filled in."""
    if cfg.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {cfg.zero_stage}")
    base = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "train_batch_size": cfg.micro_batch_size * cfg.grad_accum * world_size,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        "steps_per_print": 2**31 - 1,  # the loop prints its own progress
    }
    if cfg.deepspeed_config is None:
        return base
    template = json.loads(Path(cfg.deepspeed_config).read_text())
    filled = _fill_auto(template, base, cfg.deepspeed_config)
    stage = filled.get("zero_optimization", {}).get("stage")
    if stage != cfg.zero_stage:
        raise ValueError(
            f"{cfg.deepspeed_config} sets ZeRO stage {stage} but zero_stage is {cfg.zero_stage}"
        )
    return filled


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
    examples: Sequence[data.Example], kind: str, cfg: TrainConfig, model: Any, ref_model: Any
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
    lengths: list[int], cfg: TrainConfig, epoch: int, rank: int, world: int
) -> list[list[int]]:
    """This rank's micro-batches of an epoch. With several ranks the batch list is padded by
    wrapping around (as torch's DistributedSampler does) so every rank takes the same number of
    steps: ZeRO's collectives would hang otherwise."""
    batches = data.length_bucketed_batches(
        lengths, cfg.micro_batch_size, seed=cfg.seed, epoch=epoch, chunk_batches=cfg.bucket_batches
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


def _lr_lambda(total: int, cfg: TrainConfig) -> Callable[[int], float]:
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


def _save_state(
    engine: Any,
    state_dir: Path,
    fingerprint: str,
    step: int,
    epoch: int,
    batch_index: int,
    history: list[dict[str, float]],
) -> None:
    """Save a resumable train state, then drop older ones (DeepSpeed writes 'latest' only after a
    complete save, so a crash mid-save still resumes from the previous state)."""
    tag = f"step{step}"
    client = dict(step=step, epoch=epoch, batch_index=batch_index, history=history)
    client |= {"torch_rng": torch.get_rng_state(), "fingerprint": fingerprint}
    engine.save_checkpoint(str(state_dir), tag=tag, client_state=client)
    dist.barrier()
    if dist.get_rank() == 0:
        for old in state_dir.iterdir():
            if old.is_dir() and old.name != tag:
                shutil.rmtree(old, ignore_errors=True)


def _load_state(
    engine: Any, state_dir: Path, fingerprint: str
) -> tuple[int, int, int, list[dict[str, float]]]:
    """(step, epoch, batch index, history) of the latest train state, or the start of training."""
    if not (state_dir / "latest").exists():
        return 0, 0, 0, []
    _, client = engine.load_checkpoint(str(state_dir))
    if client["fingerprint"] != fingerprint:
        raise ValueError(
            f"{state_dir} holds the train state of a different run; delete it to start over"
        )
    torch.set_rng_state(client["torch_rng"])
    return client["step"], client["epoch"], client["batch_index"], client["history"]


def _fingerprint(cfg: TrainConfig, kind: str, lengths: list[int], world: int) -> str:
    # Everything that changes which parameters a step produces; not the checkpoint or log cadence.
    knobs = {
        k: v
        for k, v in dataclasses.asdict(cfg).items()
        if k not in ("checkpoint_every", "log_every")
    }
    blob = json.dumps([knobs, kind, lengths, world], sort_keys=True)
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
