"""Benchmark: what ``flywheel run`` spends outside its stages on a first run, for this checkout
and another one side by side, on one finished store where every stage is a cache hit.

    .venv/bin/python -m benchmarks.startup --against /path/to/other/checkout   # after `make demo`
    .venv/bin/python -m benchmarks.startup --work-dir work --repeats 3

Each run starts as the first run of a fresh clone does: a new Prefect home (the server creates
its database), a new MLflow database (``tracking.uri`` in a temporary folder; MLflow creates its
tables) and no ``.pyc`` files (``PYTHONPYCACHEPREFIX`` set to an empty folder, so every module
is compiled again, as after the runtime install, which skips byte-compiling). What is left is
start-up: imports, Prefect's server, MLflow, the walk over cached stages, the report, and the
shut-down. The checkouts alternate, ``--repeats`` times each; every run must exit 0 with every
stage a cache hit (the same artifact ids), or the benchmark stops. Without ``--against`` it
times this checkout alone. The other checkout needs its own ``.venv``. The runs rewrite the run's
report and its report state (the same table), nothing else of the work folder.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def run_once(checkout: Path, config: str, work_dir: Path) -> tuple[float, int]:
    """Seconds of one cold `flywheel run` from ``checkout`` over ``work_dir``, and its cache hits."""
    with tempfile.TemporaryDirectory(prefix="startup-") as tmp:
        env = os.environ | {
            "PREFECT_HOME": str(Path(tmp) / "prefect"),
            "PYTHONPYCACHEPREFIX": str(Path(tmp) / "pyc"),
            "HF_HUB_OFFLINE": "1",
        }
        env.pop("PREFECT_API_URL", None)
        uri = "sqlite:///" + str(Path(tmp) / "mlflow" / "mlflow.db")
        argv = [
            str(checkout / ".venv" / "bin" / "flywheel"), "run", "--config", config,
            f"run.work_dir={work_dir}", f"tracking.uri={uri}",
        ]  # fmt: skip
        start = time.perf_counter()
        done = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True)
        took = time.perf_counter() - start
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-2000:]
        sys.exit(f"benchmarks.startup: {checkout}: flywheel run exited {done.returncode}:\n{tail}")
    return took, done.stdout.count("cache hit")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default="work", help="a finished run's work folder")
    parser.add_argument("--config", default="configs/default.yaml", help="the run's config")
    parser.add_argument("--against", default=None, help="another checkout to compare with")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    work_dir = Path(args.work_dir).resolve()
    if not (work_dir / "store").is_dir():
        parser.error(f"--work-dir {args.work_dir}: no store there (run `make demo` first)")
    checkouts = {"this": HERE}
    if args.against is not None:
        other = Path(args.against).resolve()
        if not (other / ".venv" / "bin" / "flywheel").is_file():
            parser.error(f"--against {args.against}: no .venv/bin/flywheel there")
        checkouts["against"] = other
    times: dict[str, list[float]] = {name: [] for name in checkouts}
    hits: set[int] = set()
    for k in range(args.repeats):
        # Alternate which goes first, so a drift of the host's speed falls on both.
        order = list(checkouts) if k % 2 == 0 else list(reversed(checkouts))
        for name in order:
            took, n = run_once(checkouts[name], args.config, work_dir)
            times[name].append(took)
            hits.add(n)
            print(
                f"{name:<8} run {k + 1}/{args.repeats}: {took:6.1f} s, {n} cache hits", flush=True
            )
    if len(hits) != 1 or 0 in hits:
        sys.exit(f"benchmarks.startup: the runs did not all hit the same cached stages: {hits}")
    print(f"\n{'checkout':<8} {'median s':>9} {'runs':>24}  vs this")
    base = statistics.median(times["this"])
    for name, path in checkouts.items():
        med = statistics.median(times[name])
        runs = " ".join(f"{t:.1f}" for t in times[name])
        print(f"{name:<8} {med:9.1f} {runs:>24}  {med / base:.2f}x  ({path})")


if __name__ == "__main__":
    main()
