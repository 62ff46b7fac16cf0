"""Benchmark: the vectorised Pareto selection of flywheel/pareto.py (per-trajectory ranks, ETO and
best-vs-worst pairs, ET-Agent group selection) next to a plain-Python version of the same
selection (loops over row dicts, the textbook O(N^2) non-dominated sort, and each pair's sides
cut row by row with ``flywheel.trajectory.Trajectory.split``, where the vectorised path evaluates
the same stored-ids rule, ``stored_span``, on whole columns).

    .venv/bin/python -m benchmarks.bench_pareto                      # 1,000,000 trajectories, K=8
    .venv/bin/python -m benchmarks.bench_pareto --n 100000 --python-n 8000 --stage
    .venv/bin/python -m benchmarks.bench_pareto --n 4000 --python-n 800     # a few seconds

The synthetic trajectories are built column by column in Arrow (no Python rows). Plain Python
runs on a subsample (the first ``--python-n`` trajectories, whole tasks); both implementations
run on that subsample and must agree exactly, and the table compares per-trajectory times.
Every pair's prompt is the chosen side's opening, the messages before its first trained
assistant turn (here instruction, ``Ok.``, first observation). ``--stage`` also times
stages.pareto end to end (artifact read, both writes, the plot).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import polars as pl
import pyarrow as pa

from data_contracts import trajectories
from flywheel.pareto import build_pairs, select_groups, trajectory_ranks
from flywheel.trajectory import Trajectory

BUDGET_SHARE = 4  # select a quarter of the tasks' groups, so a front overflows and is cut
OPENING = 3  # the synthetic trajectories open with instruction, Ok., first observation


# -- synthetic data ---------------------------------------------------------------------------------


def _messages(turns: np.ndarray, ends_on_assistant: np.ndarray) -> pa.Array:
    """instruction, Ok., first observation, then (action, observation) per turn."""
    n_msgs = OPENING + 2 * turns - ends_on_assistant
    offsets = np.r_[0, np.cumsum(n_msgs)].astype(np.int32)
    pos = np.arange(offsets[-1]) - np.repeat(offsets[:-1], n_msgs)
    assistant = (pos == 1) | ((pos >= OPENING) & ((pos - OPENING) % 2 == 0))
    text = np.where(pos == 0, 0, np.where(pos == 1, 1, np.where(assistant, 2, 3))).astype(np.int32)
    words = pa.array(["Solve the task.", "Ok.", "Thought: add.\nAction: <python>1+1</python>", "2"])
    content = pa.DictionaryArray.from_arrays(pa.array(text), words).cast(pa.string())
    role = pa.DictionaryArray.from_arrays(
        pa.array(assistant.astype(np.int32)), pa.array(["user", "assistant"])
    )
    loss = pa.array(assistant & (pos >= OPENING))
    structs = pa.StructArray.from_arrays(
        [role.cast(pa.string()), content, loss], fields=list(trajectories.MESSAGE)
    )
    return pa.ListArray.from_arrays(pa.array(offsets), structs)


def _nested(
    turns: np.ndarray, values: np.ndarray, per_turn: int, outer_type: pa.DataType
) -> pa.Array:
    inner = pa.ListArray.from_arrays(
        pa.array(np.arange(0, len(values) + 1, per_turn, dtype=np.int32)), pa.array(values)
    )
    outer = pa.ListArray.from_arrays(pa.array(np.r_[0, np.cumsum(turns)].astype(np.int32)), inner)
    return outer.cast(outer_type)


def synth(n: int, k: int, seed: int = 0) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``n`` explore trajectories (K per task, half the tasks binary ``arith``, half graded
    ``wiki``) and one expert trajectory per task. Turn ids are 2-id placeholders per turn."""
    rng = np.random.default_rng(seed)
    t = max(1, n // k)
    n = t * k
    task = np.repeat(np.arange(t), k)
    graded = task % 2 == 1
    p = rng.random(t)[task]
    win = rng.random(n) < p
    reward = np.where(
        graded, np.round(np.clip(0.55 * win + 0.5 * rng.random(n), 0, 1), 2), win.astype(float)
    )
    success = np.where(graded, reward >= 0.75, win)
    calls = rng.integers(0, 6, n).astype(np.int32)
    turns = calls + 1
    per_turn = 2
    ids = rng.integers(0, 32000, per_turn * turns.sum()).astype(np.int32)
    explore = pa.table(
        {
            "task_id": pa.array([f"task-{i}" for i in range(t)]).take(pa.array(task)),
            "env": pa.DictionaryArray.from_arrays(
                pa.array(graded.astype(np.int32)), pa.array(["arith", "wiki"])
            ).cast(pa.string()),
            "split": pa.array(np.full(n, "train")),
            "round": pa.array(np.ones(n, np.int32)),
            "policy": pa.array(np.full(n, "sft-bench")),
            "source": pa.array(np.full(n, "explore")),
            "sample_idx": pa.array(np.tile(np.arange(k, dtype=np.int32), t)),
            "messages": _messages(turns, rng.integers(0, 2, n)),
            "reward": pa.array(reward),
            "success": pa.array(success),
            "steps": pa.array(turns),
            "tool_calls": pa.array(calls),
            "tool_errors": pa.array(np.zeros(n, np.int32)),
            "tool_ok": pa.array(calls),
            "invalid_actions": pa.array(np.zeros(n, np.int32)),
            "tokens": pa.array(rng.integers(20, 400, n).astype(np.int32)),
            "finish_reason": pa.array(np.full(n, "done")),
            "seed": pa.array(np.arange(n, dtype=np.int64)),
            "turn_token_ids": _nested(turns, ids, per_turn, pa.list_(pa.list_(pa.int32()))),
            "turn_logprobs": _nested(
                turns,
                -rng.random(len(ids)).astype(np.float32),
                per_turn,
                pa.list_(pa.list_(pa.float32())),
            ),
        },
        schema=trajectories.SCHEMA,
    )
    ex_turns = rng.integers(1, 4, t).astype(np.int32)
    ex_graded = np.arange(t) % 2 == 1
    ex_reward = np.where(ex_graded, np.round(0.6 + 0.4 * rng.random(t), 2), 1.0)
    expert = pa.table(
        {
            **{
                c: explore.column(c).take(pa.array(np.arange(t) * k))
                for c in ("task_id", "env", "split", "round")
            },
            "policy": pa.array(np.full(t, "oracle")),
            "source": pa.array(np.full(t, "expert")),
            "sample_idx": pa.array(np.zeros(t, np.int32)),
            "messages": _messages(ex_turns, np.ones(t, np.int64)),
            "reward": pa.array(ex_reward),
            "success": pa.array(ex_reward >= 0.75),
            "steps": pa.array(ex_turns),
            "tool_calls": pa.array(ex_turns),
            "tool_errors": pa.array(np.zeros(t, np.int32)),
            "tool_ok": pa.array(ex_turns),
            "invalid_actions": pa.array(np.zeros(t, np.int32)),
            "tokens": pa.array(np.zeros(t, np.int32)),
            "finish_reason": pa.array(np.full(t, "done")),
            "seed": pa.array(np.zeros(t, np.int64)),
            "turn_token_ids": pa.array([[]] * t, pa.list_(pa.list_(pa.int32()))),
            "turn_logprobs": pa.array([[]] * t, pa.list_(pa.list_(pa.float32()))),
        },
        schema=trajectories.SCHEMA,
    )
    return cast(pl.DataFrame, pl.from_arrow(explore)), cast(pl.DataFrame, pl.from_arrow(expert))


# -- the vectorised selection -----------------------------------------------------------------------


def vectorised(
    explore: pl.DataFrame, expert: pl.DataFrame, budget: int
) -> tuple[dict[str, float], dict[str, Any]]:
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    ranks = trajectory_ranks(explore)
    times["ranks"] = time.perf_counter() - t0
    ranked = explore.with_columns(pareto_rank=pl.Series(ranks, dtype=pl.Int32))
    t0 = time.perf_counter()
    pairs = build_pairs(ranked, expert)
    times["pairs"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    groups = select_groups(explore, budget=budget)
    times["groups"] = time.perf_counter() - t0
    return times, {"ranks": ranks, "pairs": pairs, "groups": groups}


# -- the same selection in plain Python ---------------------------------------------------------


def _dominates(a: tuple, b: tuple) -> bool:
    return all(x >= y for x, y in zip(a, b, strict=True)) and any(
        x > y for x, y in zip(a, b, strict=True)
    )


def _fronts(points: list[tuple]) -> list[int]:
    """Deb's fast non-dominated sort, O(M N^2)."""
    n = len(points)
    beats: list[list[int]] = [[] for _ in range(n)]
    count = [0] * n
    for i in range(n):
        for j in range(n):
            if i != j and _dominates(points[i], points[j]):
                beats[i].append(j)
                count[j] += 1
    front = [0] * n
    current = [i for i in range(n) if count[i] == 0]
    level = 1
    while current:
        nxt = []
        for i in current:
            front[i] = level
            for j in beats[i]:
                count[j] -= 1
                if count[j] == 0:
                    nxt.append(j)
        current, level = nxt, level + 1
    return front


def _crowding(points: list[tuple], front: list[int]) -> list[float]:
    dist = [0.0] * len(points)
    members: dict[int, list[int]] = defaultdict(list)
    for i, f in enumerate(front):
        members[f].append(i)
    for idx in members.values():
        for m in range(len(points[0])):
            order = sorted(idx, key=lambda i: (points[i][m], i))
            lo, hi = points[order[0]][m], points[order[-1]][m]
            dist[order[0]] = dist[order[-1]] = math.inf
            for a, b, c in zip(order, order[1:], order[2:], strict=False):
                if hi > lo:
                    dist[b] += (points[c][m] - points[a][m]) / (hi - lo)
    return dist


def _opening(msgs: Sequence[dict]) -> int:
    """Messages before the first trained assistant turn (all of them when none is trained)."""
    for i, m in enumerate(msgs):
        if m["role"] == "assistant" and m["loss"]:
            return i
    return len(msgs)


def _cut(row: dict, opening: int, limit: int) -> tuple[list[dict], list] | None:
    """The row's continuation after its first ``opening`` messages, cut after its last assistant
    turn before message ``limit``, with the stored ids of its generated turns: two
    ``Trajectory.split`` calls, the row-by-row path. None when no assistant turn is left."""
    msgs = row["messages"]
    last = max((i for i, m in enumerate(msgs[:limit]) if m["role"] == "assistant"), default=-1)
    if last < opening:
        return None
    head, _ = Trajectory(msgs, row["turn_token_ids"]).split(last + 1)
    _, continuation = head.split(opening)
    return continuation.messages, continuation.turn_token_ids


def python_selection(
    rows: list[dict], experts: list[dict], budget: int
) -> tuple[dict[str, float], dict[str, Any]]:
    """The same three outputs as ``vectorised``, timed per part, from row dicts."""
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    by_task: dict[tuple, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        by_task[(r["env"], r["task_id"])].append(i)
    ranks = [0] * len(rows)
    for idx in by_task.values():
        pts = [(rows[i]["reward"], -rows[i]["tool_calls"], -rows[i]["tokens"]) for i in idx]
        for i, f in zip(idx, _fronts(pts), strict=True):
            ranks[i] = f
    times["ranks"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    pairs = _python_pairs(rows, experts, by_task, ranks)
    times["pairs"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    groups = _python_groups(rows, by_task, budget)
    times["groups"] = time.perf_counter() - t0
    return times, {"ranks": ranks, "pairs": pairs, "groups": groups}


def _python_pairs(
    rows: list[dict],
    experts: list[dict],
    by_task: dict[tuple, list[int]],
    ranks: list[int],
    margin: float = 0.0,
    cut_extra: int = 10,
) -> list[tuple]:
    gold: dict[tuple, dict] = {}
    for e in experts:
        key = (e["env"], e["task_id"])
        e = {**e, "reward": 1.0 if e["reward"] is None else e["reward"], "sample_idx": -1}
        if key not in gold or (e["reward"], -len(e["messages"])) > (
            gold[key]["reward"],
            -len(gold[key]["messages"]),
        ):
            gold[key] = e
    candidates = []
    for key, idx in by_task.items():
        if key in gold:
            g = gold[key]
            for i in idx:
                r = rows[i]
                if r["reward"] != g["reward"]:
                    candidates.append(
                        ("expert", r, g) if r["reward"] > g["reward"] else ("expert", g, r)
                    )
        best = min(
            idx,
            key=lambda i: (-rows[i]["reward"], ranks[i], rows[i]["tokens"], rows[i]["sample_idx"]),
        )
        worst = min(
            idx,
            key=lambda i: (rows[i]["reward"], -ranks[i], -rows[i]["tokens"], rows[i]["sample_idx"]),
        )
        if rows[best]["reward"] - rows[worst]["reward"] > margin:
            candidates.append(("best_worst", rows[best], rows[worst]))
    pairs = []
    for kind, c, r in candidates:
        opening = _opening(c["messages"])  # the chosen side's, for both sides
        chosen = _cut(c, opening, len(c["messages"]))
        rejected = _cut(r, opening, len(c["messages"]) + cut_extra)
        if chosen and rejected:
            policy = c["policy"] if c["sample_idx"] >= 0 else r["policy"]
            pairs.append(
                (
                    c["env"],
                    c["task_id"],
                    kind,
                    c["sample_idx"],
                    r["sample_idx"],
                    c["reward"],
                    r["reward"],
                    policy,
                    c["messages"][:opening],
                    *chosen,
                    *rejected,
                )
            )
    return sorted(pairs)


def _python_groups(
    rows: list[dict], by_task: dict[tuple, list[int]], budget: int, threshold: float = 0.75
) -> list[tuple]:
    stats = []
    for key in sorted(by_task):
        idx = by_task[key]
        n = len(idx)
        calls = [rows[i]["tool_calls"] for i in idx]
        wins = sum(bool(rows[i]["success"]) for i in idx)
        rewards = [rows[i]["reward"] for i in idx]
        lo, hi = min(rewards), max(rewards)
        if all(x in (0.0, 1.0) for x in rewards):
            ok = lo == 0.0 and hi == 1.0
        else:
            ok = hi >= threshold and lo < threshold
        if ok:
            x1 = (n * sum(c * c for c in calls) - sum(calls) ** 2) / (n * n)
            stats.append((key, (float(x1), float(wins * (n - wins)) / (n * n))))
    pts = [p for _, p in stats]
    front = _fronts(pts)
    crowd = _crowding(pts, front)
    order = sorted(range(len(pts)), key=lambda i: (front[i], -crowd[i], i))[:budget]
    return [(stats[i][0], front[i], crowd[i]) for i in order]


# -- comparing, timing, printing --------------------------------------------------------------------


def _as_python(out: dict[str, Any]) -> dict[str, Any]:
    p = out["pairs"]
    cols = [
        "env",
        "task_id",
        "kind",
        "chosen_sample_idx",
        "rejected_sample_idx",
        "chosen_reward",
        "rejected_reward",
        "policy",
        "prompt",
        "chosen",
        "chosen_turn_token_ids",
        "rejected",
        "rejected_turn_token_ids",
    ]
    pairs = sorted(zip(*(p[c].to_list() for c in cols), strict=True))
    g = out["groups"].filter(pl.col("selected"))
    groups = [
        ((e, t), f, c)
        for e, t, f, c in zip(g["env"], g["task_id"], g["front"], g["crowding"], strict=True)
    ]
    return {"ranks": out["ranks"].tolist(), "pairs": pairs, "groups": groups}


def check_same(vec: dict[str, Any], ref: dict[str, Any]) -> None:
    """Raise AssertionError (also under ``python -O``) where the two selections differ."""

    def expect(ok: bool, what: str) -> None:
        if not ok:
            raise AssertionError(f"vectorised and plain Python differ: {what}")

    expect(vec["ranks"] == ref["ranks"], "per-trajectory ranks")
    expect(vec["pairs"] == ref["pairs"], f"pairs ({len(vec['pairs'])} vs {len(ref['pairs'])})")
    expect(len(vec["groups"]) == len(ref["groups"]), "selected group counts")
    for (ka, fa, ca), (kb, fb, cb) in zip(vec["groups"], ref["groups"], strict=True):
        # exact: both sides compute the variances from integer sums and crowding with the same
        # float operations in the same order
        expect(
            (ka, fa, ca) == (kb, fb, cb),
            f"selected group {ka} (front {fa}, crowding {ca}) vs {kb}, {fb}, {cb}",
        )


def run_stage(explore: pl.DataFrame, expert: pl.DataFrame, budget: int) -> float:
    from pydantic import Field

    from flywheel.config import Config
    from flywheel.store import Store
    from stages import pareto as stage

    class BenchConfig(Config):
        pareto: stage.ParetoConfig = Field(default_factory=stage.ParetoConfig)

    with tempfile.TemporaryDirectory() as tmp:
        store = Store(tmp, run="bench")
        refs = []
        for name, frame in (("explore", explore), ("expert", expert)):
            w = store.writer("trajectories", stage=name, round=1, config={}, inputs=[])
            table = frame.to_arrow().cast(trajectories.SCHEMA)
            for i, start in enumerate(range(0, table.num_rows, 100_000)):
                w.write_shard(i, table.slice(start, 100_000))
            refs.append(w.commit())
        t0 = time.perf_counter()
        pairs, groups = stage.run(
            BenchConfig(pareto=stage.ParetoConfig(budget=budget)), store, *refs, round=1
        )
        elapsed = time.perf_counter() - t0
        print(
            f"stage: {pairs.summary['pairs']} pairs, {groups.summary['groups_selected']} groups "
            f"({groups.summary['trajectories_selected']} rows) in {elapsed:.1f}s"
        )
    return elapsed


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; the times (``full``, ``subsample``, ``python``) and the sizes."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="explore trajectories")
    ap.add_argument("--k", type=int, default=8, help="samples per task")
    ap.add_argument(
        "--python-n", type=int, default=16_000, help="trajectories in the plain-Python subsample"
    )
    ap.add_argument("--stage", action="store_true", help="also time stages.pareto end to end")
    args = ap.parse_args(argv)
    for name in ("n", "k", "python_n"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")

    t0 = time.perf_counter()
    explore, expert = synth(args.n, args.k)
    n = len(explore)
    print(
        f"synthetic: {n} trajectories, {len(expert)} tasks, K={args.k} ({time.perf_counter() - t0:.1f}s)"
    )
    full_times, full = vectorised(explore, expert, budget=len(expert) // BUDGET_SHARE)
    print(
        f"full run: {len(full['pairs'])} pairs, {int(full['groups']['selected'].sum())} groups selected"
    )

    sub_tasks = max(1, args.python_n // args.k)
    sub_explore, sub_expert = explore.head(sub_tasks * args.k), expert.head(sub_tasks)
    m = len(sub_explore)
    sub_budget = max(1, sub_tasks // BUDGET_SHARE)
    sub_times, sub = vectorised(sub_explore, sub_expert, budget=sub_budget)
    rows, experts = sub_explore.to_dicts(), sub_expert.to_dicts()  # conversion not timed
    py_times, ref = python_selection(rows, experts, budget=sub_budget)
    check_same(_as_python(sub), ref)
    print(
        f"subsample: the first {m} trajectories; vectorised and plain Python agree on every rank, "
        f"all {len(ref['pairs'])} pairs and the {len(ref['groups'])} selected groups"
    )

    print()
    print(
        f"{'':10}{'vectorised, ' + format(n, ',') + ' traj.':>26}{'on the ' + format(m, ',') + ' subsample':>44}"
    )
    print(
        f"{'part':10}{'s':>10}{'us/traj':>10}{'':6}{'vect. s':>10}{'Python s':>10}{'us/traj':>10}{'ratio':>8}"
        f"{'per-traj ratio':>16}"
    )
    for part in [*full_times, "total"]:
        fs = sum(full_times.values()) if part == "total" else full_times[part]
        vs = sum(sub_times.values()) if part == "total" else sub_times[part]
        ps = sum(py_times.values()) if part == "total" else py_times[part]
        f_us, p_us = 1e6 * fs / n, 1e6 * ps / m
        print(
            f"{part:10}{fs:>10.2f}{f_us:>10.2f}{'':6}{vs:>10.3f}{ps:>10.2f}{p_us:>10.1f}{ps / vs:>7.0f}x"
            f"{p_us / f_us:>15.0f}x"
        )
    print(
        "ratio: same subsample, same output. per-traj ratio: plain Python's us/traj on the subsample over the\n"
        "vectorised us/traj on the full run (Python's group sort is O(N^2), so at full size it would be worse)."
    )
    stage_seconds = None
    if args.stage:
        stage_seconds = run_stage(explore, expert, budget=len(expert) // BUDGET_SHARE)
    return {
        "n": n,
        "subsample": m,
        "pairs": len(ref["pairs"]),
        "groups": len(ref["groups"]),
        "times": {"full": full_times, "subsample": sub_times, "python": py_times},
        "stage_seconds": stage_seconds,
    }


if __name__ == "__main__":
    main()
