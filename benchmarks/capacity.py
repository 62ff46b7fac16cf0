"""How far SFT alone takes a policy: the converged bootstrap's held-out success by policy width
and number of demonstrations, on the embedded default's env (arith).

The rounds and the ``rft`` baseline both imitate the policy's own successes. When the converged
SFT policy trained on demonstrations for *every* train task scores little above them, the policy
is at its capacity: no round recipe can then stand far above ``rft``, since both are near what
perfect data gives. This measures that ceiling next to the default bootstrap (500
demonstrations), for each width asked for, on the same test tasks.

Each cell is the bootstrap of ``flywheel run run.rounds=0 'baselines=[]'`` (tasks, expert, init,
sft until the val loss stops improving, evaluate on test), run by calling the stages directly:
no Prefect, no MLflow, so it runs where only torch, transformers, DeepSpeed, polars and pyarrow
are installed (a GPU machine with the project's wheels carried to it). Every cell is a run of
its own in ``--work``; a rerun reuses finished artifacts like ``flywheel run`` does.

    python -m benchmarks.capacity --widths 128 256 --demos 500 4000 --out capacity.json
    DS_ACCELERATOR=cuda python -m benchmarks.capacity --widths 256 512 --demos 500 4000

A cell's overrides (``hidden_size`` h, MLP 3h, heads h/32, ``expert.n_tasks`` n) give the same
artifact ids as ``flywheel run`` with those overrides, so a CPU run of the CLI and this script
share their cache when pointed at the same work folder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import stages.evaluate
import stages.expert
import stages.init
import stages.sft
import stages.tasks
from flywheel.config import Config, load_config
from flywheel.store import Store

CHECKOUT = Path(__file__).resolve().parents[1]


def cell_overrides(width: int, demos: int, seed: int, extra: list[str]) -> list[str]:
    """The config overrides of one cell: width h (4 layers, MLP 3h, heads of 32), n demonstrations."""
    if width % 32:
        raise SystemExit(f"capacity: width {width} is not a multiple of 32 (heads of 32)")
    return [
        f"run.name=cap-w{width}-d{demos}-s{seed}",
        f"run.seed={seed}",
        "run.rounds=0",
        "baselines=[]",
        "tracking.enabled=false",
        f"model.tiny.hidden_size={width}",
        f"model.tiny.intermediate_size={3 * width}",
        f"model.tiny.num_heads={width // 32}",
        f"expert.n_tasks={demos}",
        # One bootstrap run per cell, as the recorded cells ran: the default's restarts would
        # measure the best of up to three data orders instead.
        "sft.restarts=1",
        *extra,
    ]


def bootstrap(cfg: Config) -> dict[str, Any]:
    """Round 0 of the flow (flows/flywheel.py ``bootstrap``) without Prefect: the SFT policy's
    test evaluation and what its training kept."""
    store = Store(cfg.run.store_root(), cfg.run.name)
    train, val, test = stages.tasks.run(cfg, store)
    expert = stages.expert.run(cfg, store, train, val)
    for key, value in expert.summary.items():
        # The oracle's replay runs every tool call through the sandbox: where the sandbox
        # cannot start, every call fails and the whole cell would be wasted.
        if key.endswith("/oracle_success") and value < 0.99:
            raise SystemExit(f"capacity: {key} is {value:.1%}; does the sandbox run here?")
    init = stages.init.run(cfg, store, expert, train)
    t0 = time.perf_counter()
    sft = stages.sft.run(cfg, store, init, [expert], round=0, val_tasks=val, val_demos=expert)
    sft_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ev = stages.evaluate.run(cfg, store, sft, test, round=0)
    eval_s = time.perf_counter() - t0
    env = cfg.envs[0].name
    rate = float(ev.summary[f"{env}/success_rate"])
    n = int(cfg.envs[0].n_test)
    return {
        "sft": sft.id,
        "eval": ev.id,
        "parameters": init.summary.get("num_params"),
        "sft_summary": {k: v for k, v in sft.summary.items() if not isinstance(v, (list, dict))},
        "success_rate": rate,
        "stderr": math.sqrt(rate * (1 - rate) / n),
        "by_calls": {
            k.rsplit("_", 1)[1]: float(v)
            for k, v in ev.summary.items()
            if k.startswith(f"{env}/success_rate_d")
        },
        "sft_s": round(sft_s, 1),
        "eval_s": round(eval_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[128], help="hidden sizes")
    ap.add_argument("--demos", type=int, nargs="+", default=[500, 4000], help="expert.n_tasks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default=str(CHECKOUT / "configs" / "default.yaml"))
    ap.add_argument("--work", default="work", help="run.work_dir of every cell")
    ap.add_argument("--out", help="write the results as JSON here (rewritten after every cell)")
    ap.add_argument("overrides", nargs="*", help="more key.sub=value overrides for every cell")
    args = ap.parse_args(argv)

    results: dict[str, Any] = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cells": [],
    }
    for width in args.widths:
        for demos in args.demos:
            overrides = cell_overrides(width, demos, args.seed, args.overrides)
            cfg = load_config(args.config, [*overrides, f"run.work_dir={args.work}"])
            t0 = time.perf_counter()
            cell = {"width": width, "demos": demos, "seed": args.seed, **bootstrap(cfg)}
            cell["total_s"] = round(time.perf_counter() - t0, 1)
            results["cells"].append(cell)
            print(
                f"capacity: width {width} ({cell['parameters']} parameters), {demos} "
                f"demonstrations: {100 * cell['success_rate']:.1f}% +- "
                f"{100 * cell['stderr']:.1f} on test, kept step "
                f"{cell['sft_summary'].get('best_step')} ({cell['total_s']} s)",
                flush=True,
            )
            if args.out:
                Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"{'width':>6} {'params':>10} {'demos':>6} {'test success':>14}")
    for c in results["cells"]:
        rate = f"{100 * c['success_rate']:.1f} +- {100 * c['stderr']:.1f}"
        print(f"{c['width']:>6} {c['parameters']!s:>10} {c['demos']:>6} {rate:>14}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
