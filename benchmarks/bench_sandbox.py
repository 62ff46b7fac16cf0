"""Benchmark: per-call latency of flywheel/envs/sandbox ``run_python`` in its two modes, ``fork``
(a forked child of the fork server, the default) and ``spawn`` (a fresh interpreter per call),
side by side, sequentially and from a pool of threads, on the code the arith expert runs.

    .venv/bin/python -m benchmarks.bench_sandbox                    # 200 calls per cell, 8 threads
    .venv/bin/python -m benchmarks.bench_sandbox --calls 500 --threads 16 --expert 2000

Per cell: mean, median and p95 latency of one call as its caller sees it (waiting for one of the
sandbox's ``MAX_CONCURRENT`` slots included), wall time / calls (the inverse of throughput), and
CPU time / calls (ours, the fork server's and every child's, user + system), the steadiest
number on a shared machine: there wall times follow the other processes' load. Every output is
checked. The fork server is started before timing: its start (~30-50 ms, once
per process) is printed separately. ``--expert N`` also times the expert stage's work on N arith
train tasks (``flywheel.agent.expert_episodes``: every tool call through ``ArithEnv``, 8 env
workers) in each mode.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flywheel.agent import expert_episodes
from flywheel.envs import arith
from flywheel.envs.sandbox import MAX_CONCURRENT, Mode, run_python
from flywheel.envs.sandbox import runner as sandbox

MODES: tuple[Mode, ...] = ("fork", "spawn")


def _call(mode: Mode, i: int) -> float:
    start = time.perf_counter()
    result = run_python(f"print({i} * 7 + 12)", timeout_s=5.0, mode=mode)
    elapsed = time.perf_counter() - start
    if result.output != f"{i * 7 + 12}\n":
        raise RuntimeError(f"{mode} call {i} returned {result}")
    return elapsed


def _cpu_s() -> float:
    """CPU seconds of this process, its reaped children and the fork server with its children."""
    ours = os.times()
    total = ours.user + ours.system + ours.children_user + ours.children_system
    server = sandbox._fork_server.pid()
    if server is not None:  # Linux: utime, stime, cutime, cstime in clock ticks
        fields = Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()
        total += sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return total


def _cell(mode: Mode, calls: int, threads: int) -> dict[str, float]:
    cpu = _cpu_s()
    start = time.perf_counter()
    if threads == 1:
        latencies = [_call(mode, i) for i in range(calls)]
    else:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            latencies = list(pool.map(lambda i: _call(mode, i), range(calls)))
    wall = time.perf_counter() - start
    cpu = _cpu_s() - cpu
    ms = sorted(1e3 * t for t in latencies)
    return {
        "mean": statistics.fmean(ms),
        "p50": ms[len(ms) // 2],
        "p95": ms[min(len(ms) - 1, int(0.95 * len(ms)))],
        "wall/call": 1e3 * wall / calls,
        "cpu/call": 1e3 * cpu / calls,
    }


def _expert(n: int) -> None:
    suite = arith.ArithSuite()
    tasks = suite.tasks("train", n, seed=0)
    print(f"\nexpert_episodes on {n} arith tasks, 8 env workers")
    times = {}
    for mode in MODES:
        arith.run_python = functools.partial(run_python, mode=mode)
        try:
            start = time.perf_counter()
            rows = expert_episodes(suite, tasks)
            times[mode] = time.perf_counter() - start
        finally:
            arith.run_python = run_python
        calls = sum(len(suite.expert(t)) - 1 for t in tasks)
        success = sum(r["success"] for r in rows) / len(rows)
        print(
            f"{mode:6} {times[mode]:7.2f} s  {1e3 * times[mode] / calls:6.2f} ms per tool call "
            f"({calls} calls, oracle success {success:.0%})"
        )
    print(f"spawn/fork {times['spawn'] / times['fork']:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per mode and setting")
    parser.add_argument("--threads", type=int, default=8, help="threads of the parallel setting")
    parser.add_argument("--expert", type=int, default=0, help="also time N arith expert episodes")
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

    print(f"\n{args.calls} calls per cell, ms per call (MAX_CONCURRENT={MAX_CONCURRENT})")
    print(f"{'setting':14}{'metric':11}{'fork':>9}{'spawn':>9}{'spawn/fork':>12}")
    for setting, _ in settings:
        for metric in ("mean", "p50", "p95", "wall/call", "cpu/call"):
            fork, spawn = results[setting, "fork"][metric], results[setting, "spawn"][metric]
            print(f"{setting:14}{metric:11}{fork:>9.2f}{spawn:>9.2f}{spawn / fork:>11.1f}x")
    if args.expert:
        _expert(args.expert)


if __name__ == "__main__":
    main()
