"""Benchmark: one round's explore and DPO on a GPU, against a bf16 matrix-product ceiling measured
in the same process (issue 13, item 9).

Three measurements, one process:

1. **ceiling**: ``--matmul-n``-cubed bf16 matrix products (random data, ten timed after three
   warm-ups, CUDA events, median): the TFLOP/s the card reaches on the best case of the work the
   model does.
2. **rollout**: the project's ``hf`` engine (bf16, prefix cache on) through ``run_episodes`` on
   ``craft`` (pure Python, no sandbox), ``--episodes`` episodes (two samples per task, temperature
   1, up to ``--max-steps`` turns of ``--max-new-tokens``): episodes/s, generated tokens/s, the
   share of wall time in env steps, and the model's forward TFLOP/s (2N per prompt token run and
   per generated token; attention not counted), which decoding, bound by memory, keeps far under
   the ceiling.
3. **dpo**: pairs made from those rollouts (per task, the higher-reward sample against the other;
   ties: sample 0 chosen), encoded as the dpo stage encodes them, trained by the project's loop
   (``flywheel.training.loop.train``: DeepSpeed, ZeRO-2, bf16 on one GPU, the ``dpo`` section's
   defaults: micro-batch 16, beta 0.1) with the reference log-probs precomputed first
   (``compute_ref_logps``, the stage's default ``reference: precomputed``).
   FLOPs per trained sequence of T real tokens: 6NT for the policy's forward and backward, plus
   attention 12·L·d·T² (QK^T and AV, no causal discount); the reference pass 2NT + 4·L·d·T². N
   counts every parameter once (the tied embedding as the LM head's matrix product). MFU = those
   FLOPs per second over the measured ceiling; tokens/s counts real (non-padding) tokens over
   optimizer steps 2..N (step 1 pays DeepSpeed's set-up).

The policy is a random-init Llama built by ``flywheel.model.build_tiny_model`` (default: hidden
1536, 16 layers, 12 heads, MLP 4608, about 0.49B parameters) with the embedded word-level
tokenizer trained on craft text (about 1,300 tokens): the LM head is a small share of the FLOPs,
where a 150k-token vocabulary would make it a large one. The vllm engine is not measured here when
vllm is not installed (it runs in its own environment, DESIGN.md "Engines"); the JSON says so.

    python -m benchmarks.gpu --out gpu.json                                   # a GPU machine
    nice -n 10 .venv/bin/python -m benchmarks.gpu --small --out /tmp/gpu.json # CPU smoke, ~15 s
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch
import transformers

from benchmarks._policy import tiny_policy
from benchmarks.rollouts import TimedSuite
from flywheel.agent import run_episodes
from flywheel.config import DpoConfig, TrainSection
from flywheel.engines.base import SamplingParams
from flywheel.engines.hf import HFEngine
from flywheel.envs.craft import CraftSuite
from flywheel.training import data
from flywheel.training.loop import LossParams, compute_ref_logps, train
from flywheel.trajectory import Trajectory

FULL = {"hidden": 1536, "layers": 16, "heads": 12, "intermediate": 4608}
SMALL = {"hidden": 64, "layers": 2, "heads": 4, "intermediate": 192}


# -- the ceiling ---------------------------------------------------------------------------------


def matmul_ceiling(device: torch.device, n: int, warmup: int = 3, repeats: int = 10) -> dict:
    """TFLOP/s of an n x n x n matrix product: bf16 on a GPU, float32 on a CPU (median)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator(device).manual_seed(0)
    a = torch.randn((n, n), device=device, dtype=dtype, generator=generator)
    b = torch.randn((n, n), device=device, dtype=dtype, generator=generator)
    reference = a[:64].double() @ b.double()
    out = a @ b
    error = float((out[:64].double() - reference).norm() / reference.norm())
    for _ in range(warmup):
        torch.matmul(a, b, out=out)
    seconds = []
    for _ in range(repeats):
        seconds.append(_timed(device, lambda: torch.matmul(a, b, out=out)))
    median = statistics.median(seconds)
    return {
        "n": n,
        "dtype": str(dtype).removeprefix("torch."),
        "median_ms": median * 1e3,
        "tflops": 2 * n**3 / median / 1e12,
        "relative_error": error,
    }


def _timed(device: torch.device, fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` takes on ``device`` (CUDA events on a GPU)."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


# -- the policy ----------------------------------------------------------------------------------


def build_policy(suite: CraftSuite, shape: dict[str, int]) -> tuple[torch.nn.Module, Any]:
    """A random-init Llama of ``shape`` and a tokenizer trained on craft text (float32, CPU)."""
    return tiny_policy(
        suite,
        hidden=shape["hidden"],
        layers=shape["layers"],
        heads=shape["heads"],
        intermediate=shape["intermediate"],
        max_positions=4096,
    )


def parameter_count(model: torch.nn.Module) -> int:
    """Every parameter once (tied weights are one tensor)."""
    return sum(p.numel() for p in model.parameters())


# -- rollouts ------------------------------------------------------------------------------------


def rollouts(
    model: torch.nn.Module,
    tokenizer: Any,
    suite: CraftSuite,
    device: torch.device,
    n_params: int,
    args: argparse.Namespace,
) -> tuple[dict, list[dict]]:
    """``args.episodes`` craft episodes through the hf engine; the numbers and the rows."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    engine = HFEngine(model.to(dtype), tokenizer, device=str(device), batch_size=args.episodes)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    # Warm-up: CUDA context, cuBLAS handles and the allocator's first blocks stay out of the timing.
    warm = suite.tasks("val", 4, seed=1)
    run_episodes(engine, suite, warm, sampling=SamplingParams(max_new_tokens=4), max_steps=1)
    engine.stats = dict.fromkeys(engine.stats, 0)
    timed = TimedSuite(cast(Any, suite))
    tasks = suite.tasks("train", max(1, args.episodes // 2), seed=7)
    _sync(device)
    start = time.perf_counter()
    rows = run_episodes(
        engine, timed, tasks, samples_per_task=2, sampling=sampling, max_steps=args.max_steps
    )
    _sync(device)
    seconds = time.perf_counter() - start
    engine.close()
    stats = dict(engine.stats)
    peak = _peak_memory(device)
    if args.profile_rollout:
        profile_rollout(engine, suite, tasks, sampling, device, args.profile_rollout)
    run_tokens = stats["prompt_tokens"] + stats["generated_tokens"]
    tflops = 2 * n_params * run_tokens / seconds / 1e12
    return {
        "engine": f"hf ({str(dtype).removeprefix('torch.')}, prefix cache on)",
        "env": "craft",
        "episodes": len(rows),
        "max_steps": args.max_steps,
        "max_new_tokens": args.max_new_tokens,
        "seconds": seconds,
        "episodes_per_s": len(rows) / seconds,
        "generated_tokens": stats["generated_tokens"],
        "generated_tokens_per_s": stats["generated_tokens"] / seconds,
        "prompt_tokens_run": stats["prompt_tokens"],
        "prompt_tokens_reused": stats["reused_tokens"],
        "mean_turns": statistics.mean(r["steps"] for r in rows),
        "env_share": timed.clock.busy() / seconds,
        "forward_tflops": tflops,
        "peak_memory_gib": peak,
    }, rows


def profile_rollout(
    engine: HFEngine,
    suite: CraftSuite,
    tasks: list[Any],
    sampling: SamplingParams,
    device: torch.device,
    top: int,
) -> None:
    """The same episodes cut at two turns (the second reuses the first's cache) under
    torch.profiler: the ``top`` operators by own device time and by own CPU time, and how much
    of the wall time the device was busy."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run_episodes(engine, suite, tasks, samples_per_task=2, sampling=sampling, max_steps=2)
        _sync(device)
        wall = time.perf_counter() - start
    engine.close()
    averages = prof.key_averages()
    busy = sum(e.self_device_time_total for e in averages) / 1e6
    print(
        f"rollout profile: {2 * len(tasks)} episodes x 2 turns, {wall:.2f} s under the profiler; "
        f"device busy {busy:.2f} s ({busy / wall:.0%} of the wall time)"
    )
    for key in ("self_device_time_total", "self_cpu_time_total"):
        if key == "self_device_time_total" and device.type != "cuda":
            continue
        print(averages.table(sort_by=key, row_limit=top, max_name_column_width=60))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory(device: torch.device) -> float | None:
    """GiB the allocator held at most since the last call (None on a CPU); frees the cache."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return peak


# -- dpo -----------------------------------------------------------------------------------------


def pairs_from(rows: list[dict], tokenizer: Any, max_length: int) -> list[data.Example]:
    """One dpo example per task: the higher-reward sample chosen (ties: sample 0), each side
    ``prompt + continuation`` on its stored ids, its generated turns trained."""
    by_task: dict[str, list[dict]] = {}
    for row in rows:
        by_task.setdefault(row["task_id"], []).append(row)
    examples = []
    for samples in by_task.values():
        if len(samples) < 2:
            continue
        chosen, rejected = sorted(samples[:2], key=lambda r: (-r["reward"], r["sample_idx"]))
        example: dict[str, Any] = {}
        for side, row in (("chosen", chosen), ("rejected", rejected)):
            ids, mask = Trajectory(row["messages"], row["turn_token_ids"]).encode(tokenizer)
            example[f"{side}_ids"], example[f"{side}_mask"] = ids, mask
        examples.append(data.truncate(example, "dpo", max_length))
    return examples


def dpo_section(args: argparse.Namespace) -> TrainSection:
    """The dpo section's defaults (round 1's lr), capped at ``--train-steps`` steps, no
    validation or checkpoints."""
    dc = DpoConfig()
    knobs = dc.model_dump(include=set(TrainSection.model_fields)) | {"lr": dc.lr[0]}
    knobs |= {"max_steps": args.train_steps, "epochs": 1000, "val_every": 0, "checkpoint_every": 0}
    if args.micro_batch is not None:
        knobs["micro_batch_size"] = args.micro_batch
    return TrainSection(**knobs)


def step_plan(examples: list[data.Example], cfg: TrainSection, seed: int) -> list[list[list[int]]]:
    """The micro-batches (example indices) of each optimizer step, in the order the loop walks
    them (one rank)."""
    lengths = [data.example_length(ex, "dpo") for ex in examples]
    plan: list[list[list[int]]] = []
    epoch = 0
    while len(plan) < (cfg.max_steps or 0):
        batches = data.length_bucketed_batches(
            lengths, cfg.micro_batch_size, seed=seed, epoch=epoch, chunk_batches=cfg.bucket_batches
        )
        for start in range(0, len(batches), cfg.grad_accum):
            plan.append(batches[start : start + cfg.grad_accum])
        epoch += 1
    return plan[: cfg.max_steps]


def sequence_lengths(examples: list[data.Example], indices: list[int]) -> list[int]:
    return [len(examples[i][side]) for i in indices for side in ("chosen_ids", "rejected_ids")]


def dpo(
    initial: torch.nn.Module,
    examples: list[data.Example],
    device: torch.device,
    shape: dict[str, int],
    n_params: int,
    ceiling: float,
    args: argparse.Namespace,
) -> dict:
    """The reference pass, then the training loop on a fresh copy of the initial weights."""
    cfg = dpo_section(args)
    attention = 4 * shape["layers"] * shape["hidden"]  # forward FLOPs per T^2 of one sequence

    # Reference log-probs, as the dpo stage computes them (bf16 on a GPU).
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    reference = copy.deepcopy(initial).to(device=device, dtype=dtype)
    compute_ref_logps(reference, examples[:2], batch_size=2, max_length=cfg.max_length)  # warm
    _sync(device)
    start = time.perf_counter()
    chosen, rejected = compute_ref_logps(
        reference, examples, batch_size=cfg.micro_batch_size, max_length=cfg.max_length
    )
    _sync(device)
    ref_seconds = time.perf_counter() - start
    del reference
    lengths = sequence_lengths(examples, list(range(len(examples))))
    ref_flops = sum(2 * n_params * t + attention * t * t for t in lengths)
    trained = [
        ex | {"ref_chosen_logp": c, "ref_rejected_logp": r}
        for ex, c, r in zip(examples, chosen, rejected, strict=True)
    ]

    # The loop: steps 2..N are timed from its per-step log records.
    ends: list[float] = []
    step_tokens: list[int] = []
    losses: list[float] = []

    def log(record: dict) -> None:
        ends.append(time.perf_counter())
        step_tokens.append(int(record["tokens"]))
        losses.append(float(record["loss"]))

    _peak_memory(device)
    policy = copy.deepcopy(initial)
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        result = train(
            policy, trained, loss="dpo", cfg=cfg, out_dir=out, seed=args.seed,
            params=LossParams(beta=0.1), log=log,
        )  # fmt: skip
        total = time.perf_counter() - start
    peak = _peak_memory(device)
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != device.type:
        raise RuntimeError(f"DeepSpeed trained on {get_accelerator().device_name()}, not {device}")
    plan = step_plan(examples, cfg, args.seed)
    planned = [sum(sum(sequence_lengths(examples, b)) for b in step) for step in plan]
    steady_s = ends[-1] - ends[0]
    steady = [b for step in plan[1:] for b in step]  # the micro-batches of steps 2..N
    tokens = sum(step_tokens[1:])

    def step_flops(step: list[list[int]]) -> float:
        lengths = [t for b in step for t in sequence_lengths(examples, b)]
        return sum(6 * n_params * t + 3 * attention * t * t for t in lengths)

    flops = sum(step_flops(step) for step in plan[1:])
    # The median step: what a step runs at once warm-up (new shapes, allocator growth) is past.
    seconds = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    by_speed = sorted(range(len(seconds)), key=lambda i: seconds[i] / step_tokens[i + 1])
    median = by_speed[len(by_speed) // 2]
    # Chosen and rejected are padded to one width, the micro-batch's longest sequence.
    padded = sum(
        2 * len(b) * max(data.example_length(examples[i], "dpo") for i in b) for b in steady
    )
    return {
        "pairs": len(examples),
        "mean_sequence_tokens": statistics.mean(lengths),
        "max_sequence_tokens": max(lengths),
        "micro_batch_size": cfg.micro_batch_size,
        "grad_accum": cfg.grad_accum,
        "zero_stage": cfg.zero_stage,
        "bf16": cfg.bf16 and device.type == "cuda",
        "reference_seconds": ref_seconds,
        "reference_tokens_per_s": sum(lengths) / ref_seconds,
        "reference_tflops": ref_flops / ref_seconds / 1e12,
        "reference_mfu": ref_flops / ref_seconds / 1e12 / ceiling,
        "steps": result.steps,
        "steady_steps": len(plan) - 1,
        "steady_seconds": steady_s,
        "train_tokens": tokens,
        "train_tokens_per_s": tokens / steady_s,
        "train_tflops": flops / steady_s / 1e12,
        "mfu": flops / steady_s / 1e12 / ceiling,
        "median_step_tokens_per_s": step_tokens[median + 1] / seconds[median],
        "median_step_mfu": step_flops(plan[median + 1]) / seconds[median] / 1e12 / ceiling,
        "padding_share": 1 - tokens / padded,
        "call_seconds": total,
        "peak_memory_gib": peak,
        "same_batches": planned == step_tokens,
        "first_loss": losses[0],
        "final_loss": losses[-1],
    }


# -- the report ----------------------------------------------------------------------------------


def environment(device: torch.device) -> dict:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "deepspeed": _version("deepspeed"),
        "vllm": _version("vllm"),
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "gpu": props.name,
            "gpu_memory_gib": props.total_memory / 2**30,
            "multiprocessors": props.multi_processor_count,
            "cuda": torch.version.cuda,
        }
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def _version(name: str) -> str | None:
    if importlib.util.find_spec(name) is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


def table(report: dict) -> str:
    c, r, d = report["ceiling"], report["rollout"], report["dpo"]
    m = report["model"]
    rows = [
        ("ceiling", f"{c['n']}^3 {c['dtype']} matmul", f"{c['median_ms']:.2f} ms", "", f"{c['tflops']:.3g}", "100%"),
        ("rollout", f"{r['engine']}, {r['episodes']} {r['env']} episodes", f"{r['seconds']:.2f}",
         f"{r['generated_tokens_per_s']:,.0f} gen", f"{r['forward_tflops']:.3g}",
         f"{r['forward_tflops'] / c['tflops']:.1%}"),
        ("dpo ref", f"compute_ref_logps, {d['pairs']} pairs", f"{d['reference_seconds']:.2f}",
         f"{d['reference_tokens_per_s']:,.0f}", f"{d['reference_tflops']:.3g}", f"{d['reference_mfu']:.1%}"),
        ("dpo train", f"loop, ZeRO-{d['zero_stage']}{' bf16' if d['bf16'] else ''}, {d['steady_steps']} steps",
         f"{d['steady_seconds']:.2f}", f"{d['train_tokens_per_s']:,.0f}", f"{d['train_tflops']:.3g}",
         f"{d['mfu']:.1%}"),
    ]  # fmt: skip
    head = ("part", "what", "seconds", "tokens/s", "TFLOP/s", "vs ceiling")
    widths = [max(len(str(x[i])) for x in [head, *rows]) for i in range(len(head))]
    lines = [
        f"policy: random-init Llama, hidden {m['hidden']}, {m['layers']} layers, {m['heads']} heads, "
        f"MLP {m['intermediate']}, vocabulary {m['vocab']:,}: {m['parameters'] / 1e6:,.1f}M parameters",
        "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)),
    ]
    lines += ["  ".join(str(v).ljust(w) for v, w in zip(x, widths, strict=True)) for x in rows]
    lines.append(
        f"rollout: {r['episodes_per_s']:.1f} episodes/s, {r['mean_turns']:.1f} turns each, env "
        f"steps {r['env_share']:.1%} of wall time, prompt tokens run {r['prompt_tokens_run']:,} "
        f"(reused {r['prompt_tokens_reused']:,}); dpo: padding {d['padding_share']:.1%}, same "
        f"batches as planned: {'yes' if d['same_batches'] else 'NO'}, loss {d['first_loss']:.4f} -> "
        f"{d['final_loss']:.4f}, whole train() call {d['call_seconds']:.1f} s"
    )
    lines.append(f"vllm engine: {report['vllm']['note']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON")
    parser.add_argument("--small", action="store_true", help="a tiny model and sizes: CPU smoke")
    parser.add_argument("--device", default=None, help="default: cuda when there is one, else cpu")
    parser.add_argument("--episodes", type=int, default=None, help="default 256 (small: 8)")
    parser.add_argument("--max-steps", type=int, default=None, help="default 6 (small: 2)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default 48 (small: 8)")
    parser.add_argument("--train-steps", type=int, default=None, help="default 40 (small: 3)")
    parser.add_argument("--micro-batch", type=int, default=None, help="default: the dpo section's")
    parser.add_argument("--matmul-n", type=int, default=None, help="default 8192 (small: 256)")
    parser.add_argument(
        "--profile-rollout",
        type=int,
        default=0,
        metavar="N",
        help="profile two turns of the rollout afterwards and print the top N operators",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    small = args.small
    for name, full, tiny in (
        ("episodes", 256, 8), ("max_steps", 6, 2), ("max_new_tokens", 48, 8),
        ("train_steps", 40, 3), ("matmul_n", 8192, 256),
    ):  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, tiny if small else full)
    if args.train_steps < 2:
        parser.error("--train-steps must be at least 2 (tokens/s is taken over steps 2..N)")
    if args.episodes < 4:
        parser.error("--episodes must be at least 4 (two samples per task make the pairs)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU")
    # The loop trains on DeepSpeed's accelerator: it must be the device measured here.
    accelerator = os.environ.setdefault("DS_ACCELERATOR", device.type)
    if accelerator != device.type:
        parser.error(f"DS_ACCELERATOR={accelerator} but the device is {device.type}: unset it")
    shape = SMALL if small else FULL

    started = datetime.datetime.now(datetime.UTC)
    ceiling = matmul_ceiling(device, args.matmul_n)
    print(
        f"ceiling: {ceiling['tflops']:.3g} TFLOP/s ({ceiling['n']}^3 {ceiling['dtype']})",
        flush=True,
    )
    suite = CraftSuite()
    initial, tokenizer = build_policy(suite, shape)
    n_params = parameter_count(initial)
    model_info = shape | {"vocab": len(tokenizer), "parameters": n_params}
    print(f"policy: {n_params / 1e6:,.1f}M parameters, vocabulary {len(tokenizer)}", flush=True)
    rollout, rows = rollouts(copy.deepcopy(initial), tokenizer, suite, device, n_params, args)
    print(f"rollout: {rollout['generated_tokens_per_s']:,.0f} generated tokens/s", flush=True)
    examples = pairs_from(rows, tokenizer, dpo_section(args).max_length)
    del rows
    trained = dpo(initial, examples, device, shape, n_params, ceiling["tflops"], args)
    vllm = _version("vllm")
    report = {
        "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.gpu", *(argv or sys.argv[1:])]),
        "date": started.isoformat(timespec="seconds"),
        "environment": environment(device),
        "model": model_info,
        "ceiling": ceiling,
        "rollout": rollout,
        "dpo": trained,
        "vllm": {
            "ran": False,
            "installed": vllm,
            "note": (
                "not run: vllm is not installed in this Python (the engine starts a vllm server "
                "from its own environment, engine.vllm.python)"
                if vllm is None
                else f"not run by this benchmark (vllm {vllm} is installed; see benchmarks/rollouts.py)"
            ),
        },
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report), flush=True)
    return report


if __name__ == "__main__":
    main()
