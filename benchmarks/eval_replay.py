"""Benchmark: what the evaluate stage spends on its recovery count after the episodes are
played, counting the failed steps from the episodes' step infos as played (what ``evaluate``
does) against replaying every episode through a fresh env (what it did before, and still does
for a shard a crashed run left), side by side on one evaluation of a store.

    .venv/bin/python -m benchmarks.eval_replay                       # after `make demo`
    .venv/bin/python -m benchmarks.eval_replay --store work/store --eval evaluate-f35aa0295450

It reads an evaluation's episodes (default: the newest round-0 evaluation of ``--store``, the
bootstrap SFT policy's), replays each once to get its step infos (as the stage has them when it
played the episodes itself), then times ``stages.evaluate.replay_columns`` both ways,
``--repeats`` times, alternating, and checks that both give the same columns. The replay's cost
is the env's own step time (arith: its sandboxed tool calls).
"""

from __future__ import annotations

import argparse
import statistics
import time

from flywheel.config import load_config
from flywheel.envs import make_suite
from flywheel.store import ArtifactError, Store
from stages._common import load_tasks
from stages.evaluate import replay_columns, replay_infos


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--store", default="work/store", help="store root (make demo's: work/store)"
    )
    parser.add_argument("--run", default="default", help="run name inside the store")
    parser.add_argument("--eval", default=None, help="an evaluate artifact id (default: round 0's)")
    parser.add_argument("--config", default="configs/default.yaml", help="the run's config")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    cfg = load_config(args.config)
    store = Store(args.store, args.run)
    try:
        ev = store.get(args.eval) if args.eval else store.latest("evaluate", round=0)
    except ArtifactError as err:
        raise SystemExit(str(err)) from None
    if ev is None:
        raise SystemExit(f"no round-0 evaluation in {args.store} (run `make demo` first)")
    if ev.stage != "evaluate":
        raise SystemExit(f"{ev.id} is not an evaluation (its stage: {ev.stage})")
    tasks = next(store.get(i) for i in ev.inputs if i.startswith("tasks-"))
    table = store.read(ev)
    episodes = table.select(["env", "task_id", "messages"]).to_pylist()
    played = {}
    for env_cfg in cfg.envs:
        suite = make_suite(env_cfg)
        by_id = {t.task_id: t for t in load_tasks(store, tasks, env=env_cfg.name, split="test")}
        for row in (r for r in episodes if r["env"] == env_cfg.name):
            infos = replay_infos(suite, by_id[row["task_id"]], row["messages"])
            played[(row["env"], row["task_id"])] = infos
    times: dict[str, list[float]] = {"infos as played": [], "replay every episode": []}
    frames = {}
    for _ in range(args.repeats):
        for name, given in (("infos as played", played), ("replay every episode", None)):
            start = time.perf_counter()
            frames[name] = replay_columns(cfg, store, tasks, table, played=given)
            times[name].append(time.perf_counter() - start)
    first, second = frames.values()
    assert first is not None and second is not None and first.equals(second), "columns differ"
    print(f"{ev.id}: {table.num_rows} episodes, {args.repeats} repeats (median seconds)")
    base = statistics.median(times["replay every episode"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:<22} {median:7.3f} s   {median / base:6.3f}x the replay")


if __name__ == "__main__":
    main()
