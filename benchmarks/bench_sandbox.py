"""Benchmark: per-call latency of flywheel/envs/sandbox.py ``run_python`` in its two modes, ``fork``
(a forked child of the fork server, the default) and ``spawn`` (a fresh interpreter per call),
side by side, sequentially and from a pool of threads, on the code the arith expert runs.

    .venv/bin/python -m benchmarks.bench_sandbox                    # 200 calls per cell, 8 threads
    .venv/bin/python -m benchmarks.bench_sandbox --calls 500 --threads 16

Per cell: mean, median and p95 latency of one call as its caller sees it (waiting for one of the
sandbox's ``MAX_CONCURRENT`` slots included), and wall time / calls (the inverse of throughput).
Every output is checked. The fork server is started before timing: its start (~50 ms, once per
process) is printed separately.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from flywheel.envs import sandbox
from flywheel.envs.sandbox import run_python

MODES = ("fork", "spawn")


def _call(mode: str, i: int) -> float:
    start = time.perf_counter()
    result = run_python(f"print({i} * 7 + 12)", timeout_s=5.0, mode=mode)  # type: ignore[arg-type]
    elapsed = time.perf_counter() - start
    if result.output != f"{i * 7 + 12}\n":
        raise RuntimeError(f"{mode} call {i} returned {result}")
    return elapsed


def _cell(mode: str, calls: int, threads: int) -> dict[str, float]:
    start = time.perf_counter()
    if threads == 1:
        latencies = [_call(mode, i) for i in range(calls)]
    else:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            latencies = list(pool.map(lambda i: _call(mode, i), range(calls)))
    wall = time.perf_counter() - start
    ms = sorted(1e3 * t for t in latencies)
    return {
        "mean": statistics.fmean(ms),
        "p50": ms[len(ms) // 2],
        "p95": ms[min(len(ms) - 1, int(0.95 * len(ms)))],
        "wall/call": 1e3 * wall / calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per mode and setting")
    parser.add_argument("--threads", type=int, default=8, help="threads of the parallel setting")
    args = parser.parse_args()

    start = time.perf_counter()
    server = sandbox._fork_server.pid()
    if server is None:
        raise SystemExit(f"the fork server did not start: {sandbox._fork_server.start_error}")
    print(f"fork server pid {server} started in {1e3 * (time.perf_counter() - start):.0f} ms")
    for mode in MODES:  # warm up: page cache, imports, the first temp dirs
        for i in range(5):
            _call(mode, i)

    settings = [("sequential", 1), (f"{args.threads} threads", args.threads)]
    results = {(s, m): _cell(m, args.calls, t) for s, t in settings for m in MODES}

    print(f"\n{args.calls} calls per cell, ms per call (MAX_CONCURRENT={sandbox.MAX_CONCURRENT})")
    print(f"{'setting':14}{'metric':11}{'fork':>9}{'spawn':>9}{'spawn/fork':>12}")
    for setting, _ in settings:
        for metric in ("mean", "p50", "p95", "wall/call"):
            fork, spawn = results[setting, "fork"][metric], results[setting, "spawn"][metric]
            print(f"{setting:14}{metric:11}{fork:>9.2f}{spawn:>9.2f}{spawn / fork:>11.1f}x")


if __name__ == "__main__":
    main()
