"""Held-out metrics of every evaluated policy, side by side, with sampling error.

``collect`` reads the evaluations of the last ``flywheel run`` (recorded in ``flywheel.json``
under the run's folder) or, when there is none, every eval artifact in the store. The run
rewrites that file when it starts, after each evaluation and at its end (``write_state``), so a
report taken while a long run is going shows that run's rows so far, and ``unfinished`` says so,
never the rows of the run before it.

Every success rate carries its binomial standard error ``sqrt(p (1 - p) / n)`` over the n test
tasks; a recovery rate carries it over the episodes it counts (``failed_episodes``: those with
an invalid or failed action), as ``recovery_se``. A round's gain over a reference policy (the
round-0 SFT policy, and the better of the baselines) is called significant when it exceeds two
standard errors of the difference, and a round more than two standard errors below its
reference is marked as well (``"below": true``).

Both policies ran the same test tasks, so the difference is measured task by task: with
``d_i = success_a(i) - success_b(i)`` in {-1, 0, 1}, its standard error is the paired one,
``sqrt((mean(d^2) - mean(d)^2) / n)``. Policies trained from one another agree on most tasks, and
the tasks both solve (or both fail) carry no sampling noise of the difference, so this is smaller
than treating the two rates as independent, ``sqrt(se_a^2 + se_b^2)``, which is used only when
the two evaluations did not run the same task ids (the gain then says ``"paired": false``).
Either way the error is that of the test sample only: how much two trained policies differ from
one training run (seed) to the next is what a second seed measures.

    flywheel report          # a table, then the gains
    flywheel report --json   # one object per policy and env (policy = init, sft, dpo, ..., sft_more, rft)

A baseline's row also carries ``seed``, the seed of its data order (its checkpoint's), since
with ``repeats`` one baseline has several rows; the table shows it as ``rft (seed 1)``. A round
trained several times (``iteration.repeats``) likewise has a row per repeat with its training
seed, and each of them carries ``repeats``: the repeats' mean success, the eval ids it averages
(``of``) and the mean's gains, measured task by task like a row's (one more line of gains).

The standard errors above are the test sample's only. Where either side of a gain over the
baselines was trained more than once (``rft.repeats``, ``iteration.repeats``), the gain also
carries ``runs``: the standard error of the difference of the two sides' mean success from how
far their training runs differ, ``s * sqrt(1/n_a + 1/n_b)`` with ``s^2`` the runs' variance
pooled over both sides (``df = n_a + n_b - 2`` degrees of freedom; one run on a side borrows
the other side's spread). It is called significant when the gain exceeds Student's t quantile
for a two-sided 95% test at that df times this error: with two runs a side, 4.3 of them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from flywheel.config import BASELINES
from flywheel.store import ArtifactError, ArtifactRef, Store, host_label

STATE_FILE = "flywheel.json"
COLUMNS = (
    "round",
    "policy",
    "env",
    "success",
    "avg_reward",
    "n_tasks",
    "avg_steps",
    "avg_tool_calls",
    "tool_success",
    "reasoning_tokens",
    "efficiency",
)
# Metrics only some envs report (recovery: envs that replay exactly; recall: envs that search a
# corpus): a column when any row has them.
OPTIONAL_COLUMNS = ("recovery_rate", "recall_at_5")


def standard_error(p: float, n: int) -> float:
    """Binomial standard error of a success rate p measured on n tasks."""
    return math.sqrt(max(p * (1.0 - p), 0.0) / n) if n > 0 else float("nan")


def paired_standard_error(a: Sequence[float], b: Sequence[float]) -> float:
    """Standard error of ``mean(a) - mean(b)`` when ``a[i]`` and ``b[i]`` are two policies'
    outcomes on the same task i: ``sqrt((mean(d^2) - mean(d)^2) / n)`` with ``d = a - b``."""
    if len(a) != len(b):
        raise ValueError(f"paired outcomes differ in length: {len(a)} and {len(b)}")
    n = len(a)
    if n == 0:
        return float("nan")
    d = [x - y for x, y in zip(a, b, strict=True)]
    mean = sum(d) / n
    return math.sqrt(max(sum(x * x for x in d) / n - mean * mean, 0.0) / n)


Outcomes = dict[str, dict[tuple[str, str], float]]  # eval id -> (env, task id) -> success

# Student's t, two-sided 95% quantiles by degrees of freedom; past 30 the report's rule of two.
T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def run_spread(mine: Sequence[float], theirs: Sequence[float]) -> dict[str, Any] | None:
    """How the difference of two sides' mean success compares with the spread of their training
    runs (each side's success rate per run): the standard error of ``mean(mine) - mean(theirs)``
    from the runs' variance pooled over both sides, its degrees of freedom and t quantile, and
    whether the difference exceeds t standard errors. None with fewer than three runs in all
    (no spread to measure)."""
    n_a, n_b = len(mine), len(theirs)
    df = n_a + n_b - 2
    if n_a == 0 or n_b == 0 or df < 1:
        return None
    mean_a, mean_b = sum(mine) / n_a, sum(theirs) / n_b
    squares = sum((x - mean_a) ** 2 for x in mine) + sum((x - mean_b) ** 2 for x in theirs)
    se = math.sqrt(squares / df * (1 / n_a + 1 / n_b))
    t = T95[df - 1] if df <= len(T95) else 2.0
    gain = mean_a - mean_b
    return {
        "se": se, "df": df, "t": t, "n": [n_a, n_b],
        "significant": bool(gain > t * se), "below": bool(gain < -t * se),
    }  # fmt: skip


def read_outcomes(store: Store, ref: ArtifactRef) -> dict[tuple[str, str], float]:
    """Every episode's success in an eval artifact, by (env, task id)."""
    table = store.read(ref, columns=["env", "task_id", "success"]).to_pydict()
    return {
        (env, task): float(ok)
        for env, task, ok in zip(table["env"], table["task_id"], table["success"], strict=True)
    }


def read_state(store: Store) -> dict[str, Any] | None:
    """The last ``flywheel run``'s record (``flywheel.json``), or None when no run wrote one."""
    path = f"{store.base}/{STATE_FILE}"
    if not store.fs.exists(path):
        return None
    with store.fs.open(path, "r") as fh:
        try:
            state = json.load(fh)
        except json.JSONDecodeError as err:
            raise ArtifactError(f"corrupted run record {path}: {err}") from None
    if not isinstance(state, dict):
        raise ArtifactError(f"corrupted run record {path}: not a JSON object")
    return state


def write_state(store: Store, rounds: int, evaluations: list[str], finished: bool) -> None:
    """Record the run's evaluations so far; written whole and renamed into place, so a kill
    mid-write leaves the previous record."""
    path = f"{store.base}/{STATE_FILE}"
    state = {"run": store.run, "rounds": rounds, "finished": finished, "evaluations": evaluations}
    store.fs.makedirs(store.base, exist_ok=True)
    with store.fs.open(f"{path}.part", "w") as fh:
        json.dump(state, fh, indent=2)
    store.fs.mv(f"{path}.part", path)


def unfinished(store: Store) -> str | None:
    """A one-line note when the last ``flywheel run`` has not reached its end (still running,
    or killed: rerunning it resumes), else None. Records written before ``finished`` existed
    were written at a run's end."""
    state = read_state(store)
    if state is None or state.get("finished", True):
        return None
    n = len(state.get("evaluations", []))
    return (
        f"note: the last `flywheel run` of {store.run} has not finished (still running, or "
        f"stopped before its end: rerun it to resume); {n} of its evaluations so far"
    )


def collect(store: Store) -> list[dict[str, Any]]:
    state = read_state(store)
    if state is not None:
        refs = [store.get(i) for i in state.get("evaluations", [])]
    else:
        refs = store.list(stage="evaluate")
    rows = []
    outcomes: Outcomes = {}
    for ref in refs:
        if ref.kind != "eval":
            raise ArtifactError(f"artifact {ref.id} is not an eval artifact")
        outcomes[ref.id] = read_outcomes(store, ref)
        seed = None
        if ref.manifest.get("policy_stage") in BASELINES:
            # A baseline's repeats differ only by the seed of their data order: say which is which.
            seed = checkpoint_seed(store, ref.manifest.get("policy", ""))
        by_env: dict[str, dict[str, Any]] = {}
        for key, value in ref.summary.items():
            env, _, metric = key.partition("/")
            by_env.setdefault(env, {})[metric] = value
        for env, metrics in sorted(by_env.items()):
            row = {
                "round": ref.round,
                "policy": ref.manifest.get("policy_stage", "?"),
                "checkpoint": ref.manifest.get("policy", ""),
                "eval_id": ref.id,
                "env": env,
                **metrics,
            }
            row["n_tasks"] = int(row.get("n_tasks", 0))
            if seed is not None:
                row["seed"] = seed
            if "success_rate" in row:
                row["success_se"] = standard_error(row["success_rate"], row["n_tasks"])
            if "recovery_rate" in row and row.get("failed_episodes"):
                # its n is the episodes that had an invalid or failed action, not the tasks
                failed = int(row["failed_episodes"])
                row["recovery_se"] = standard_error(row["recovery_rate"], failed)
            rows.append(row)
    _seed_repeated_rounds(store, rows)
    add_gains(rows, outcomes)
    return rows


def checkpoint_seed(store: Store, checkpoint: str) -> int | None:
    """The training seed a checkpoint's config records (None without one, or without an id)."""
    return store.get(checkpoint).manifest.get("config", {}).get("seed") if checkpoint else None


def _seed_repeated_rounds(store: Store, rows: list[dict[str, Any]]) -> None:
    """Give each row of a round evaluated several times (iteration.repeats) the training seed of
    its checkpoint, in place, so the table says which repeat is which (each checkpoint's
    manifest read once, however many envs it was evaluated on)."""
    seeds: dict[str, int | None] = {}
    for group in _round_repeats(rows):
        for row in group:
            ckpt = row.get("checkpoint", "")
            if ckpt not in seeds:
                seeds[ckpt] = checkpoint_seed(store, ckpt)
            if seeds[ckpt] is not None:
                row["seed"] = seeds[ckpt]


def _round_repeats(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Rows of one round, policy and env that were evaluated more than once (a round's repeats,
    or its reruns), each group in the rows' order."""
    groups: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        if row["round"] >= 1 and row["policy"] not in BASELINES and "success_rate" in row:
            groups.setdefault((row["round"], row["policy"], row["env"]), []).append(row)
    return [g for g in groups.values() if len(g) > 1]


def _paired(
    row: dict[str, Any], ref: dict[str, Any], outcomes: Outcomes | None
) -> tuple[list[float], list[float]] | None:
    """Both rows' outcomes task by task, when both evaluations ran the same tasks of the env."""
    if not outcomes or row.get("eval_id") not in outcomes or ref.get("eval_id") not in outcomes:
        return None
    env = row["env"]
    mine = {k: v for k, v in outcomes[row["eval_id"]].items() if k[0] == env}
    theirs = {k: v for k, v in outcomes[ref["eval_id"]].items() if k[0] == env}
    if not mine or mine.keys() != theirs.keys():
        return None
    keys = sorted(mine)
    return [mine[k] for k in keys], [theirs[k] for k in keys]


def _gain(
    row: dict[str, Any],
    ref: dict[str, Any],
    outcomes: Outcomes | None,
    runs: Sequence[dict[str, Any]] | None = None,
    ref_runs: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """``row``'s gain over ``ref`` with its test-sample standard error; given the training runs
    each side stands for (``runs``, ``ref_runs``), also their spread (``runs``, run_spread)."""
    pairs = _paired(row, ref, outcomes)
    if pairs is not None:
        a, b = pairs
        diff = (sum(a) - sum(b)) / len(a)
        se = paired_standard_error(a, b)
    else:
        diff = row["success_rate"] - ref["success_rate"]
        se = math.sqrt(row["success_se"] ** 2 + ref["success_se"] ** 2)
    gain = {
        "gain": diff,
        "se": se,
        "significant": bool(diff > 2 * se),
        "below": bool(diff < -2 * se),
        "over": ref["policy"],
        "paired": pairs is not None,
    }
    if runs is not None:
        rates = [[r["success_rate"] for r in rs] for rs in (runs, ref_runs)]
        if (spread := run_spread(*rates)) is not None:
            gain["runs"] = spread
    return gain


def mean_of_repeats(rows: list[dict[str, Any]], outcomes: Outcomes) -> dict[str, Any]:
    """One reference row for several evaluations of one baseline (``repeats``, or reruns with
    another seed) in one env: the mean success, and with every repeat's episodes on the same
    tasks, their task-by-task mean filed in ``outcomes`` under a key of its own, so a round's
    gain over it is paired."""
    name, env = rows[0]["policy"], rows[0]["env"]
    p = sum(r["success_rate"] for r in rows) / len(rows)
    n = min(r["n_tasks"] for r in rows)
    mean = {
        "round": rows[0]["round"], "policy": f"{name} (mean of {len(rows)})", "env": env,
        "success_rate": p, "n_tasks": n, "success_se": standard_error(p, n),
    }  # fmt: skip
    tasks = [{k: v for k, v in outcomes.get(r.get("eval_id", ""), {}).items() if k[0] == env}
             for r in rows]  # fmt: skip
    if tasks[0] and all(t.keys() == tasks[0].keys() for t in tasks):
        key = "mean:" + ",".join(r["eval_id"] for r in rows)
        outcomes[key] = {k: sum(t[k] for t in tasks) / len(tasks) for k in tasks[0]}
        mean["eval_id"] = key
    return mean


def add_gains(rows: list[dict[str, Any]], outcomes: Outcomes | None = None) -> None:
    """Give every round's row (round >= 1, not a baseline) its gain over the round-0 SFT policy
    and over the best baseline of the same env, in place. With ``outcomes`` (each row's episodes
    by eval id) the standard error of a gain is the paired one over the tasks both ran. A
    baseline evaluated several times (its repeats) counts as the mean of its evaluations."""
    outcomes = dict(outcomes or {})  # the repeats' means are added to a copy
    for env in {r["env"] for r in rows}:
        mine = [r for r in rows if r["env"] == env and "success_rate" in r]
        sft = [r for r in mine if r["round"] == 0 and r["policy"] == "sft"]
        # Each reference row, and the training runs it stands for.
        base: list[dict[str, Any]] = []
        base_runs: list[list[dict[str, Any]]] = []
        for name in BASELINES:
            runs = [r for r in mine if r["policy"] == name]
            if len(runs) < 2:
                base += runs
                base_runs += [[r] for r in runs]
            else:
                base.append(mean_of_repeats(runs, outcomes))
                base_runs.append(runs)
        best, best_runs = (
            max(zip(base, base_runs, strict=True), key=lambda b: b[0]["success_rate"])
            if base
            else (None, [])
        )
        repeated = _round_repeats(mine)
        in_a_group = {id(r) for group in repeated for r in group}
        for row in mine:
            if row["round"] < 1 or row["policy"] in BASELINES:
                continue
            if sft:
                row["gain_over_sft"] = _gain(row, sft[-1], outcomes)
            if best is not None:
                # A repeat's own row leaves the runs' spread to the repeats' mean below.
                own = None if id(row) in in_a_group else [row]
                row["gain_over_baselines"] = _gain(row, best, outcomes, own, best_runs)
        for group in repeated:
            # A round trained several times (iteration.repeats): its mean, measured like a row,
            # filed on each repeat's row.
            mean = mean_of_repeats(group, outcomes)
            summary = {k: mean[k] for k in ("policy", "success_rate", "success_se", "n_tasks")}
            summary["of"] = [r.get("eval_id", "") for r in group]
            if sft:
                summary["gain_over_sft"] = _gain(mean, sft[-1], outcomes)
            if best is not None:
                summary["gain_over_baselines"] = _gain(mean, best, outcomes, group, best_runs)
            for row in group:
                row["repeats"] = summary


def _cell(row: dict[str, Any], col: str) -> str:
    if col == "success":
        if "success_rate" not in row:
            return ""
        return f"{100 * row['success_rate']:.1f}% ± {100 * row['success_se']:.1f}"
    if col == "recovery_rate" and "recovery_se" in row:
        return f"{100 * row['recovery_rate']:.1f}% ± {100 * row['recovery_se']:.1f}"
    if col == "recovery_rate" and row.get("failed_episodes") == 0:
        return "no failures"  # a rate over no episodes: nothing failed, so nothing to recover
    if col == "policy" and "seed" in row:
        return f"{row['policy']} (seed {row['seed']})"
    value = row.get(col, "")
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def format_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no evaluated policies yet (run `flywheel run`)"
    header = list(COLUMNS) + [c for c in OPTIONAL_COLUMNS if any(c in row for row in rows)]
    lines = [header] + [[_cell(row, col) for col in header] for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)) for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    out.append("(success: held-out success rate ± its binomial standard error)")
    if "recovery_rate" in header:
        out.append(
            "(recovery_rate: of the held-out episodes with an invalid or failed action, the share "
            "that still succeeded ± its binomial standard error over those episodes)"
        )
    gains = [
        _gain_line(row) for row in rows if "gain_over_sft" in row or "gain_over_baselines" in row
    ]
    means = {tuple(r["repeats"]["of"]): r for r in rows if "repeats" in r}
    gains += [_gain_line({**r, **r["repeats"]}) for r in means.values()]
    if gains:
        every = [
            g[key]
            for row in rows
            for g in (row, row.get("repeats", {}))
            for key in ("gain_over_sft", "gain_over_baselines")
            if key in g
        ]
        paired = [gain["paired"] for gain in every]
        if all(paired):
            how = "paired over the same test tasks"
        elif any(paired):
            how = "paired except lines marked (unpaired): the two rates treated as independent"
        else:
            how = "unpaired: the two rates treated as independent"
        out += [
            "",
            f"gains in success (points ± standard error, {how}; "
            "* = more than two above, ! = more than two below):",
            *gains,
        ]
        if any("runs" in gain for gain in every):
            out.append(
                "(runs: the gain's standard error from how far training runs differ, pooled over "
                "both sides' repeats; * = more than t above, the 95% quantile at that df)"
            )
    return "\n".join(out)


def _gain_line(row: dict[str, Any]) -> str:
    parts = []
    for key in ("gain_over_sft", "gain_over_baselines"):
        if key in row:
            g = row[key]
            mark = "*" if g["significant"] else "!" if g.get("below") else " "
            pair = "" if g.get("paired", False) else " (unpaired)"
            parts.append(
                f"vs {g['over']:<8} {100 * g['gain']:+5.1f} ± {100 * g['se']:.1f}{mark}{pair}"
            )
            if "runs" in g:
                r = g["runs"]
                mark = "*" if r["significant"] else "!" if r["below"] else ""
                parts[-1] += f" (runs: ± {100 * r['se']:.1f}, df {r['df']}, t {r['t']:.2f}{mark})"
    name = row["policy"]
    if "seed" in row and "of" not in row:  # one of a round's repeats (a mean has "of")
        name += f" (seed {row['seed']})"
    return f"  round {row['round']} {name:<5} {row['env']:<8} " + "   ".join(parts)


def resolve_eval(store: Store, name: str) -> tuple[Store, ArtifactRef]:
    """An eval artifact named ``ID`` (in ``store``) or ``RUN:ID`` (in run RUN's store under the
    same root), with the store it is in; a one-line error for anything else."""
    run, sep, art = name.rpartition(":")
    where = Store(store.root_url, run) if sep else store
    ref = where.get(art)
    if ref.kind != "eval":
        raise ValueError(f"{name} is a {ref.kind} artifact; compare reads eval artifacts")
    return where, ref


def read_tasks(store: Store, ref: ArtifactRef) -> dict[tuple[str, str], str]:
    """Every episode's task as its env stated it, by (env, task id): the last user message
    before the policy's first turn (after the suite's instruction, which a run may change)."""
    table = store.read(ref, columns=["env", "task_id", "messages"]).to_pydict()
    out = {}
    for env, task, messages in zip(table["env"], table["task_id"], table["messages"], strict=True):
        stated = ""
        for m in messages:
            if m["role"] == "assistant" and m["loss"]:
                break
            if m["role"] == "user":
                stated = m["content"]
        out[(env, task)] = stated
    return out


def read_difficulty(store: Store, ref: ArtifactRef) -> dict[tuple[str, str], int | None]:
    """Every episode's task difficulty in an eval artifact (env-defined; arith: the number of
    operations), by (env, task id)."""
    table = store.read(ref, columns=["env", "task_id", "difficulty"]).to_pydict()
    return {
        (env, task): level
        for env, task, level in zip(
            table["env"], table["task_id"], table["difficulty"], strict=True
        )
    }


def compare(store: Store, a_id: str, *b_ids: str, by_difficulty: bool = False) -> str:
    """``flywheel compare A B [B ...]``: eval artifacts (any rounds, baselines or versions, which
    the report does not set side by side), each env's success of each and the paired gain of A
    over B on the tasks all ran (± its standard error, * / ! beyond two above / below). Several
    B (repeats of one baseline with other seeds, say) are averaged task by task first, so A is
    measured against the baseline's mean rather than one draw of it. An id written ``RUN:ID``
    is read from run RUN's store (same root): two runs are paired only where their test tasks
    are the same, which is checked task by task (the first observation; the suite's instruction
    may differ). Where every evaluation reports a recovery rate, a line under the env's gives
    them (unpaired). With ``by_difficulty`` each env's lines are followed by one per difficulty
    level (A's record of it), paired over that level's tasks: where a gain comes from."""
    if not b_ids:
        raise ValueError("compare needs at least one eval artifact after the first")
    names = (a_id, *b_ids)
    found = [resolve_eval(store, name) for name in names]
    a, *bs = (read_outcomes(where, ref) for where, ref in found)
    if len({where.base for where, _ in found}) > 1:
        _check_same_tasks(names, [read_tasks(where, ref) for where, ref in found])
    levels = read_difficulty(*found[0]) if by_difficulty else {}
    against = b_ids[0] if len(b_ids) == 1 else f"the mean of {', '.join(b_ids)}"
    lines = [f"{a_id} (A) against {against} (B), paired over the tasks all ran:"]
    for env in sorted({k[0] for k in a} | {k[0] for b in bs for k in b}):
        keys = sorted(k for k in a if k[0] == env and all(k in b for b in bs))
        if not keys:
            raise ValueError(f"{a_id} and {', '.join(b_ids)} ran no task of env {env!r} in common")
        lines.append(f"  {env:<8} " + _compare_cells(keys, a, bs))
        recovery = _recovery_cells(env, [ref for _, ref in found])
        if recovery:
            lines.append(f"    recovery     {recovery}")
        if by_difficulty:
            # Levels in order; tasks without one (an env that records none) last.
            for level in sorted({levels[k] for k in keys}, key=lambda x: (x is None, x or 0)):
                at = [k for k in keys if levels[k] == level]
                lines.append(f"    difficulty {level!s:<4} " + _compare_cells(at, a, bs))
    lines += _host_note(
        [(where, ref, name) for (where, ref), name in zip(found, names, strict=True)]
    )
    return "\n".join(lines)


def _mark(gain: float, se: float) -> str:
    """``*`` beyond two standard errors above, ``!`` beyond two below, else a space."""
    return "*" if gain > 2 * se else "!" if gain < -2 * se else " "


def _compare_cells(
    keys: list[tuple[str, str]],
    a: dict[tuple[str, str], float],
    bs: list[dict[tuple[str, str], float]],
) -> str:
    """One line of ``compare`` over ``keys``: how many tasks, A's and B's success (B averaged over
    its repeats task by task) and the paired gain with its standard error."""
    xa = [a[k] for k in keys]
    xb = [sum(b[k] for b in bs) / len(bs) for k in keys]
    ra, rb = sum(xa) / len(keys), sum(xb) / len(keys)
    gain, se = ra - rb, paired_standard_error(xa, xb)
    mark = _mark(gain, se)
    each = ""
    if len(bs) > 1:
        rates = (sum(b[k] for k in keys) / len(keys) for b in bs)
        each = f" (each {', '.join(f'{100 * r:.1f}%' for r in rates)})"
    return (
        f"{len(keys):>5} tasks   A {100 * ra:5.1f}%   B {100 * rb:5.1f}%   "
        f"A - B {100 * gain:+5.1f} ± {100 * se:.1f}{mark}{each}"
    )


def _recovery_cells(env: str, refs: list[ArtifactRef]) -> str | None:
    """A's and B's recovery rate in ``env`` (B averaged over its evaluations) and A - B, when
    every evaluation reports one. Unpaired: each rate is over the policy's own episodes with an
    invalid or failed action, which are other episodes for each policy."""
    rates, ses, counts = [], [], []
    for ref in refs:
        rate = ref.summary.get(f"{env}/recovery_rate")
        failed = int(ref.summary.get(f"{env}/failed_episodes") or 0)
        if rate is None or not failed:
            return None
        rates.append(rate)
        counts.append(failed)
        ses.append(standard_error(rate, failed))
    (ra, *rest), (sa, *rest_se) = rates, ses
    rb = sum(rest) / len(rest)
    sb = math.sqrt(sum(x * x for x in rest_se)) / len(rest_se)
    gain, se = ra - rb, math.sqrt(sa * sa + sb * sb)
    mark = _mark(gain, se)
    return (
        f"A {100 * ra:.1f}% ± {100 * sa:.1f} of {counts[0]}   "
        f"B {100 * rb:.1f}% ± {100 * sb:.1f} of {', '.join(map(str, counts[1:]))}   "
        f"A - B {100 * gain:+.1f} ± {100 * se:.1f}{mark} "
        "(unpaired; of N: the episodes with an invalid or failed action)"
    )


def _check_same_tasks(names: tuple[str, ...], tasks: list[dict[tuple[str, str], str]]) -> None:
    """A one-line error when evaluations from different runs stated one task id differently
    (another env seed or difficulty): pairing them would compare different tasks."""
    first = tasks[0]
    for name, other in zip(names[1:], tasks[1:], strict=True):
        for key in sorted(first.keys() & other.keys()):
            if first[key] != other[key]:
                raise ValueError(
                    f"task {key[1]} of env {key[0]} reads differently in {names[0]} and {name}: "
                    "their runs' test tasks differ, so they cannot be paired"
                )


def lineage_hosts(store: Store, ref: ArtifactRef) -> set[str]:
    """The machines (``host_label``) that wrote ``ref`` and every artifact it was made from, as
    far as their manifests record one (manifests from before ``host`` was recorded add none)."""
    return {
        host_label(r.manifest["host"]) for r in store.ancestors([ref.id]) if r.manifest.get("host")
    }


def _host_note(found: list[tuple[Store, ArtifactRef, str]]) -> list[str]:
    """A warning when the compared policies (each in its store, under the name it was given) were
    made on different machines: one config can train to different weights where the CPU's
    kernels round differently."""
    by_ref = {name: lineage_hosts(where, ref) for where, ref, name in found}
    every = set().union(*by_ref.values())
    if len(every) < 2:
        return []
    lines = ["note: these evaluations' lineages were written on different machines, where one"]
    lines.append(
        "  config can train to different weights (docs/results.md, 'One config, two machines'):"
    )
    lines += [f"  {rid}: {'; '.join(sorted(h)) or 'not recorded'}" for rid, h in by_ref.items()]
    return lines
