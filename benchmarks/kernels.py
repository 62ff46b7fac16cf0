"""Benchmark: do torch's CPU kernels change what the demo's SFT trains to, and what does pinning
them cost?

Training on CPU runs in float32 (``bf16`` applies on an accelerator only), and float32 is not
portable either: torch picks its vector kernels by the CPU (``AVX2``, ``AVX512``), MKL its
matrix-product kernels, and a wider vector adds the terms of a sum in another order. One config
can then train to other weights on another machine (docs/results.md, "One config, two
machines"). Environment variables read when torch loads choose the kernels:
``ATEN_CPU_CAPABILITY`` (ATen's vector kernels: ``avx2``, ``avx512``, ``default``) and
``MKL_CBWR`` (MKL's: ``AVX2``, ``COMPATIBLE``, ...).

Each variant runs in its own process, since torch reads them once: ``--steps`` optimizer steps
of the demo's round-0 SFT (the bare PyTorch loop of ``benchmarks.training``: the demo's
examples, tiny policy, micro-batch, lr and schedule) from the same initial weights and batches.
The table compares each variant's final weights with the first one's (``native``: nothing
pinned), bit for bit and by the largest difference, and its CPU seconds per step (torch on
``--threads`` threads; CPU time is what other work on a shared machine disturbs least).
``native again`` checks that a variant is deterministic at all: it must be equal.

    nice -n 10 .venv/bin/python -m benchmarks.kernels --steps 20
    nice -n 10 .venv/bin/python -m benchmarks.kernels --steps 2 --variants native "native again"
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from flywheel.store import KERNEL_ENV

ROOT = Path(__file__).resolve().parents[1]

# name -> (environment variables set for the child, torch threads; None: the --threads value)
VARIANTS: dict[str, tuple[dict[str, str], int | None]] = {
    "native": ({}, None),
    "native again": ({}, None),
    "native, 2 threads": ({}, 2),
    "ATen avx2": ({"ATEN_CPU_CAPABILITY": "avx2"}, None),
    "ATen avx2 + MKL AVX2": ({"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}, None),
    "ATen default (scalar)": ({"ATEN_CPU_CAPABILITY": "default"}, None),
    "MKL COMPATIBLE": ({"MKL_CBWR": "COMPATIBLE"}, None),
}


def child(steps: int, threads: int, out: Path) -> None:
    """Train ``steps`` steps in this process; write the weights and a JSON summary to ``out``."""
    import torch

    from benchmarks.training import demo_examples, plan_steps, run_bare
    from flywheel.config import load_config

    torch.set_num_threads(threads)
    cfg = load_config(ROOT / "configs" / "default.yaml")
    sc = cfg.sft.model_copy(update={"max_steps": steps, "val_every": 0, "checkpoint_every": 0})
    examples, _, model = demo_examples(cfg)
    plan = plan_steps([len(ex["input_ids"]) for ex in examples], sc, cfg.run.seed, steps)
    run = run_bare(model, examples, sc, plan)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(weights, out.with_suffix(".pt"))
    digest = hashlib.sha256(b"".join(w.numpy().tobytes() for w in weights.values()))
    summary = {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "loss": run.losses[-1],
        "digest": digest.hexdigest()[:12],
        # steps 2..N: step 1 carries one-off allocations
        "cpu_per_step": run.steady_cpu() / (len(run.cpu) - 1) if len(run.cpu) > 1 else 0.0,
    }
    out.write_text(json.dumps(summary))


def run_variant(name: str, steps: int, threads: int, folder: Path) -> dict[str, Any]:
    """One variant in a fresh process with its pins set (and every other kernel pin of the
    caller's environment cleared)."""
    pins, own_threads = VARIANTS[name]
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_ENV} | pins
    env.setdefault("HF_HUB_OFFLINE", "1")
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{hashlib.sha1(name.encode()).hexdigest()[:8]}.json"
    args = ["--child", str(out), "--steps", str(steps), "--threads", str(own_threads or threads)]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        raise SystemExit(f"variant {name!r} failed (exit {proc.returncode}): {' '.join(tail)}")
    return json.loads(out.read_text()) | {"weights": out.with_suffix(".pt")}


def largest_difference(a: Path, b: Path) -> float:
    """The largest absolute difference between two runs' final weights."""
    import torch

    wa, wb = torch.load(a), torch.load(b)
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per variant")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier)")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANTS),
        choices=list(VARIANTS),
        help="variants to run; the first is the one the others are compared with",
    )
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.child:
        child(args.steps, args.threads, args.child)
        return
    print(
        f"demo sft, {args.steps} steps from the same weights and batches, one process per "
        f"variant; compared with {args.variants[0]!r}"
    )
    print(
        f"{'variant':<24} {'kernels':>8} {'thr':>3} {'final loss':>18} {'weights':>12} "
        f"{'equal':>5} {'max |dw|':>9} {'cpu s/step':>10} {'vs first':>8}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        first: dict[str, Any] | None = None
        for name in args.variants:
            r = run_variant(name, args.steps, args.threads, Path(tmp))
            first = first or r
            diff = largest_difference(first["weights"], r["weights"])
            # CPU seconds compare speeds only at one thread count (2 threads count both)
            same = r["threads"] == first["threads"] and r["cpu_per_step"]
            speed = f"{first['cpu_per_step'] / r['cpu_per_step']:.2f}x" if same else "-"
            print(
                f"{name:<24} {r['capability']:>8} {r['threads']:>3} {r['loss']:>18.15f} "
                f"{r['digest']:>12} {'yes' if r['digest'] == first['digest'] else 'no':>5} "
                f"{diff:>9.2e} {r['cpu_per_step']:>10.3f} {speed:>8}",
                flush=True,
            )
    print(
        "equal: the final weights are the first variant's bit for bit. vs first: the first "
        "variant's CPU seconds per step over this one's (above 1: this one is faster; '-' at "
        "another thread count)."
    )


if __name__ == "__main__":
    main()
