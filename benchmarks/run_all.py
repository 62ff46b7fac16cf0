"""Every benchmark, one after another, each printing its own side-by-side table (``make bench``).

    .venv/bin/python benchmarks/run_all.py          # small sizes: a few minutes on 2 cores
    .venv/bin/python benchmarks/run_all.py --full   # the sizes benchmarks/README.md records

Each benchmark runs in its own process (``python -m benchmarks.<name> ...``) so one's threads,
caches and imports do not colour the next one's timings. Exits non-zero if any of them fails.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> (small arguments, full arguments)
BENCHMARKS: dict[str, tuple[list[str], list[str]]] = {
    "bench_pareto": (["--n", "100000", "--python-n", "4000"], []),
    "bench_sandbox": (["--calls", "50"], []),
    "chat_encoding": (["--episodes", "32"], []),
    "kernels": (["--steps", "4", "--variants", "native", "native again", "ATen avx2"], []),
    "mcts_tokens": (["--nodes", "8"], []),
    "multiturn": (["--episodes", "64"], []),
    "rollouts": (
        ["--episodes", "1", "16", "64", "--sequential-cap", "16"]
        + ["--engines", "--engine-episodes", "16"],
        ["--engines"],
    ),
    "training": (
        ["--steps", "10", "--bucket-batches", "1", "4", "16", "--repeats", "2"]
        + ["--length-split", "1", "2"],
        ["--repeats", "3", "--profile", "10", "--length-split", "1", "2", "3", "4"],
    ),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the sizes the README records")
    parser.add_argument("only", nargs="*", help=f"run only these ({', '.join(BENCHMARKS)})")
    args = parser.parse_args()
    unknown = sorted(set(args.only) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)}; benchmarks: {', '.join(BENCHMARKS)}")
    failed = []
    for name, (small, full) in BENCHMARKS.items():
        if args.only and name not in args.only:
            continue
        command = [sys.executable, "-m", f"benchmarks.{name}", *(full if args.full else small)]
        print(f"== {name}: {' '.join(command[1:])}", flush=True)
        start = time.perf_counter()
        rc = subprocess.run(command, cwd=ROOT).returncode
        print(f"== {name}: exit {rc}, {time.perf_counter() - start:.0f} s\n", flush=True)
        if rc:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
