"""The HTML report: the numbers of ``flywheel report`` as plots and tables, plus the explored
trajectories worth reading, in a folder of static pages that a browser opens from the file
system or from any web server.

    flywheel report --html            # writes <run.work_dir>/report/<run.name>/, prints index.html
    flywheel report --html PATH       # writes the folder PATH, prints PATH/index.html

``write_html(store, out)`` writes ``out/index.html`` and ``out/trajectories/*.html``:

- held-out success per round and env (round 0 = the SFT policy) with binomial standard-error
  bars; the untrained policy and the baselines as horizontal reference lines;
- held-out success per task difficulty, per round;
- the reward and tool-call distributions of each round's explore artifact;
- the last round's Pareto ranks over (reward up, tool calls down, tokens down), computed by
  ``flywheel.pareto.trajectory_ranks`` on the explore artifact as the pareto stage does (its
  groups artifact stores them only for the selected groups), front 1 highlighted and the
  selected groups' trajectories ringed;
- the best, the worst and the revised (``source == "revision"``) trajectories of each round
  and env, one page each: roles, message contents, loss flags, actions, tokens and rewards;
- the evaluation table with the cells of ``flywheel report``, and its text verbatim;
- where the time went: seconds per round and stage, from the manifests (``started``,
  ``seconds``, ``resumed``: flywheel/store.py) of the evaluations' lineage.

Which evaluations: those of ``flywheel.report.collect``; the explore, pareto and revision
artifacts are found through their lineage. Every number shown is read from those artifacts.
Each plot is a ``<figure class="plot" id=...>`` of inline SVG (``flywheel.html_plot``) whose
marks carry their values in ``data-*`` attributes, beside a table of the same values.

The pages are built in memory, written to a hidden sibling folder and renamed into place:
``out`` holds the previous report or the new one, never half of one. ``out`` may be missing,
empty or an earlier report; any other folder is refused rather than replaced.
"""

from __future__ import annotations

import html
import os
import re
import secrets
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import polars as pl

from flywheel.config import BASELINES
from flywheel.html_plot import (
    COLORS,
    GENERATOR,
    HTML,
    Bar,
    Plot,
    attrs,
    figure,
    legend,
    nice_axis,
    page,
    pct,
    rate_axis,
    slug,
    table,
    value_ticks,
)
from flywheel.pareto import trajectory_ranks
from flywheel.progress import duration
from flywheel.report import COLUMNS, _cell, collect, format_table, standard_error, unfinished
from flywheel.store import ArtifactRef, Store
from flywheel.trajectory import align_turn_ids

MAX_REVISED = 5  # revised trajectories given a page, per round and env
MAX_TOOL_BIN = 20  # tool-call counts from here on share the last bin
REFERENCES = ("init", *BASELINES)  # drawn as horizontal lines, not as rounds
DASH = {"init": "1 3", "sft_more": "6 4", "rft": "2 3"}
FRONT, OTHER = "#c44e52", "#9aa6b8"
_ACTION = re.compile(r"<([A-Za-z_][\w-]*)>.*?</\1>", re.DOTALL)


def write_html(store: Store, out: Path | str) -> Path:
    """Write the report of ``store``'s run into the folder ``out``; returns ``out/index.html``.

    A one-line ValueError when there is nothing to report or ``out`` cannot be written; then
    nothing is written."""
    out = Path(out).absolute()
    _check_target(out)
    every = collect(store)
    note = unfinished(store)
    if not any("success_rate" in r for r in every):
        if note:
            raise ValueError(f"no evaluated policies yet: {note.removeprefix('note: ')}")
        raise ValueError("no evaluated policies yet (run `flywheel run`)")
    _write_folder(out, _build(store, every, note))
    return out / "index.html"


# -- reading the artifacts ---------------------------------------------------------------------


@dataclass
class Data:
    rows: list[dict[str, Any]]  # flywheel.report.collect rows that have a success rate
    difficulty: pl.DataFrame  # eval_id, env, difficulty, n, successes, success_rate
    explore: dict[int, tuple[ArtifactRef, pl.DataFrame]]  # round -> explore artifact, + pareto_rank
    revised: dict[int, pl.DataFrame]  # round -> its rows with source == "revision"
    groups: ArtifactRef | None  # the last round's GRPO groups (pareto stage)
    selected: pl.DataFrame  # env, task_id, sample_idx of the groups' trajectories
    lineage: list[ArtifactRef]  # the evaluations and everything they were made from


def _frame(store: Store, ref: ArtifactRef, columns: list[str] | None = None) -> pl.DataFrame:
    return cast(pl.DataFrame, pl.from_arrow(store.read(ref, columns)))


def _newest(refs: Iterable[ArtifactRef]) -> ArtifactRef | None:
    ordered = sorted(refs, key=lambda r: (r.manifest.get("created", ""), r.id))
    return ordered[-1] if ordered else None


def _load(store: Store, rows: list[dict[str, Any]]) -> Data:
    parts = []
    for eval_id in dict.fromkeys(r["eval_id"] for r in rows):
        frame = _frame(store, store.get(eval_id), ["env", "difficulty", "success"])
        parts.append(
            frame.group_by("env", "difficulty")
            .agg(n=pl.len(), successes=pl.col("success").sum().cast(pl.Int64))
            .with_columns(eval_id=pl.lit(eval_id), success_rate=pl.col("successes") / pl.col("n"))
        )
    difficulty = pl.concat(parts).sort("eval_id", "env", "difficulty")

    known = store.ancestors((r["eval_id"] for r in rows), skip_missing=True)
    explore: dict[int, tuple[ArtifactRef, pl.DataFrame]] = {}
    revised: dict[int, pl.DataFrame] = {}
    for rnd in sorted({ref.round for ref in known}):
        here = [r for r in known if r.round == rnd and r.kind == "trajectories"]
        ref = _newest(r for r in here if r.stage == "explore")
        if ref is not None and ref.manifest.get("rows"):  # an empty one has nothing to plot
            traj = _frame(store, ref)
            ranks = pl.Series(trajectory_ranks(traj), dtype=pl.Int32)
            explore[rnd] = (ref, traj.with_columns(pareto_rank=ranks))
        mine = [
            _frame(store, r).filter(pl.col("source") == "revision")
            for r in here
            if r.stage not in ("explore", "expert")
        ]
        if sum(len(f) for f in mine):
            revised[rnd] = pl.concat(mine)

    keys = {"env": pl.String, "task_id": pl.String, "sample_idx": pl.Int32}
    groups, selected = None, pl.DataFrame(schema=keys)
    if explore:
        last = explore[max(explore)][0]
        candidates = store.list(round=last.round, stage="pareto")
        groups = _newest(r for r in candidates if r.kind == "groups" and last.id in r.inputs)
        if groups is not None:
            selected = _frame(store, groups, list(keys))
    return Data(rows, difficulty, explore, revised, groups, selected, known)


# -- the plots -----------------------------------------------------------------------------------


def _main_series(rows: list[dict[str, Any]], env: str) -> list[dict[str, Any]]:
    """The policy of each round for ``env``: round 0's SFT policy, then each round's output
    (the last evaluation of a round when there are several; of a round's repeats, the first,
    which is the run's own)."""
    by_round = {
        r["round"]: r
        for r in rows
        if r["env"] == env
        and r["policy"] not in REFERENCES
        and ("repeats" not in r or r["repeats"]["of"][0] == r["eval_id"])
    }
    return [by_round[r] for r in sorted(by_round)]


def _row_data(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "env": row["env"],
        "round": row["round"],
        "policy": row["policy"],
        "eval-id": row["eval_id"],
        "success": float(row["success_rate"]),
        "se": float(row["success_se"]),
        "n": row["n_tasks"],
    }


def _success_plot(rows: list[dict[str, Any]], env: str) -> str:
    series = _main_series(rows, env)
    refs = [r for r in rows if r["env"] == env and r["policy"] in REFERENCES]
    rounds = [r["round"] for r in series + refs]
    top, yticks = rate_axis(max(r["success_rate"] + r["success_se"] for r in series + refs))
    plot = Plot(min(rounds) - 0.5, max(rounds) + 0.5, 0.0, top, right=110)
    ticks = [(r["round"], f"{r['round']} {r['policy']}") for r in series]
    plot.axes(ticks, yticks, "round (policy)", "held-out success")
    keys = [("SFT (round 0), then each round's policy", COLORS[0], "line")]
    for i, ref in enumerate(refs):
        color = "#888888" if ref["policy"] == "init" else COLORS[(i + 1) % len(COLORS)]
        name = "init (untrained)" if ref["policy"] == "init" else ref["policy"]
        plot.reference(
            ref["success_rate"],
            f"{name} {pct(ref['success_rate'])}",
            color,
            DASH.get(ref["policy"], "4 2"),
            _row_data(ref),
        )
        keys.append((f"{name}, round {ref['round']}", color, "dashed"))
    if len(series) > 1:
        points = " ".join(f"{plot.x(r['round'])},{plot.y(r['success_rate'])}" for r in series)
        plot.parts.append(f'<polyline class="series" points="{points}" stroke="{COLORS[0]}"/>')
    for r in series:
        p, se = r["success_rate"], r["success_se"]
        plot.errorbar(r["round"], p - se, p + se, COLORS[0])
        tip = f"round {r['round']} {r['policy']}: {pct(p)} ± {100 * se:.1f} (n={r['n_tasks']})"
        geometry = {"class": "point", "cx": plot.x(r["round"]), "cy": plot.y(p), "r": 5}
        plot.mark("circle", {**geometry, "fill": COLORS[0]}, _row_data(r), tip)
    values = table(
        ["round", "policy", "success", "s.e.", "n tasks", "eval artifact"],
        [
            [
                (r["round"], r["round"]),
                (r["policy"], None),
                (pct(r["success_rate"]), float(r["success_rate"])),
                (f"{100 * r['success_se']:.1f}", float(r["success_se"])),
                (r["n_tasks"], r["n_tasks"]),
                (r["eval_id"], None),
            ]
            for r in sorted(series + refs, key=lambda r: (r["round"], r["policy"]))
        ],
    )
    caption = (
        f"<b>{html.escape(env)}</b>: held-out success of the SFT policy (round 0) and of each "
        "round's policy, ± one binomial standard error sqrt(p(1-p)/n) over the n test tasks. "
        "Horizontal lines: the untrained policy and the baselines."
    )
    svg = plot.svg(f"success per round, {env}", env=env)
    return figure(f"success-by-round-{slug(env)}", [svg], legend(keys), caption, values)


def _difficulty_plot(data: Data, env: str) -> str:
    series = _main_series(data.rows, env)
    by_eval = {r["eval_id"]: r for r in data.rows}
    frame = data.difficulty.filter(pl.col("env") == env)
    levels = sorted(set(frame["difficulty"].to_list()))
    bars = []
    for i, row in enumerate(series):
        for d in frame.filter(pl.col("eval_id") == row["eval_id"]).iter_rows(named=True):
            p, n, k = d["success_rate"], d["n"], d["successes"]
            name = f"round {row['round']} {row['policy']}"
            bars.append(
                Bar(
                    group=levels.index(d["difficulty"]),
                    series=i,
                    value=float(p),
                    color=COLORS[i % len(COLORS)],
                    data={
                        "env": env,
                        "round": row["round"],
                        "policy": row["policy"],
                        "difficulty": d["difficulty"],
                        "success": float(p),
                        "n": n,
                    },
                    tip=f"{name}, difficulty {d['difficulty']}: {pct(p)} ({k}/{n})",
                    se=standard_error(p, n),
                )
            )
    top, yticks = rate_axis(max([b.value + (b.se or 0.0) for b in bars] or [0.0]))
    plot = Plot(-0.5, len(levels) - 0.5, 0.0, top)
    xticks = [(g, f"difficulty {level}") for g, level in enumerate(levels)]
    plot.axes(xticks, yticks, "task difficulty", "held-out success")
    plot.bars(bars, len(series))

    def order(d: dict[str, Any]) -> tuple[int, str, int]:
        return by_eval[d["eval_id"]]["round"], by_eval[d["eval_id"]]["policy"], d["difficulty"]

    values = table(
        ["round", "policy", "difficulty", "success", "solved", "n tasks", "eval artifact"],
        [
            [
                (by_eval[d["eval_id"]]["round"], by_eval[d["eval_id"]]["round"]),
                (by_eval[d["eval_id"]]["policy"], None),
                (d["difficulty"], d["difficulty"]),
                (pct(d["success_rate"]), float(d["success_rate"])),
                (d["successes"], d["successes"]),
                (d["n"], d["n"]),
                (d["eval_id"], None),
            ]
            for d in sorted(frame.iter_rows(named=True), key=order)
        ],
    )
    caption = (
        f"<b>{html.escape(env)}</b>: held-out success per task difficulty of each round's policy "
        "(the eval artifacts' rows grouped by <code>difficulty</code>), ± one binomial standard "
        "error. The table also lists the untrained policy and the baselines."
    )
    keys = legend(
        [
            (f"round {r['round']} {r['policy']}", COLORS[i % len(COLORS)], "box")
            for i, r in enumerate(series)
        ]
    )
    svg = plot.svg(f"success per difficulty, {env}", env=env)
    return figure(f"success-by-difficulty-{slug(env)}", [svg], keys, caption, values)


def _histogram(
    data: Data, fig_id: str, what: str, bins: list[str], bin_of: pl.Expr, caption: str
) -> str:
    """Episodes per bin of ``bin_of`` (an index into ``bins``), one bar per round."""
    rounds = sorted(data.explore)
    bars = []
    for i, rnd in enumerate(rounds):
        ref, traj = data.explore[rnd]
        for b, n in sorted(traj.select(bin=bin_of).group_by("bin").len().iter_rows()):
            bars.append(
                Bar(
                    group=b,
                    series=i,
                    value=float(n),
                    color=COLORS[i % len(COLORS)],
                    data={"round": rnd, "bin": bins[b], "count": n, "artifact": ref.id},
                    tip=f"round {rnd}, {what} {bins[b]}: {n} episodes",
                )
            )
    top, yticks = nice_axis(1.05 * max(b.value for b in bars), integer=True)
    plot = Plot(-0.5, len(bins) - 0.5, 0.0, top)
    every = max(1, len(bins) // 10)
    xticks = [(g, label) for g, label in enumerate(bins) if g % every == 0]
    plot.axes(xticks, [(v, f"{v:g}") for v in yticks], what, "episodes")
    plot.bars(bars, len(rounds))
    values = table(
        ["round", what, "episodes", "explore artifact"],
        [
            [
                (b.data["round"], b.data["round"]),
                (b.data["bin"], None),
                (b.data["count"], b.data["count"]),
                (b.data["artifact"], None),
            ]
            for b in sorted(bars, key=lambda b: (b.series, b.group))
        ],
    )
    keys = legend([(f"round {r}", COLORS[i % len(COLORS)], "box") for i, r in enumerate(rounds)])
    return figure(fig_id, [plot.svg(f"{what} distribution of explore")], keys, caption, values)


def _explore_section(data: Data) -> str:
    if not data.explore:
        return "<p>No explore artifacts yet (they are written from round 1 on).</p>"
    summary = []
    for rnd, (ref, traj) in sorted(data.explore.items()):
        reward = float(cast(float, traj["reward"].fill_null(0.0).mean()))
        success = float(cast(float, traj["success"].fill_null(False).mean()))
        calls = float(cast(float, traj["tool_calls"].mean()))
        summary.append(
            [
                (rnd, rnd),
                (ref.id, None),
                (len(traj), len(traj)),
                (f"{reward:.3f}", reward),
                (pct(success), success),
                (f"{calls:.3f}", calls),
            ]
        )
    header = ["round", "explore artifact", "episodes", "mean reward", "success", "mean tool calls"]
    reward_bins = [f"{i / 10:.1f}-{(i + 1) / 10:.1f}" for i in range(10)]
    most = max(int(cast(int, t["tool_calls"].max() or 0)) for _, t in data.explore.values())
    last = min(most, MAX_TOOL_BIN)
    tool_bins = [str(i) for i in range(last)] + [f"{last}+" if most > MAX_TOOL_BIN else str(last)]
    return (
        table(header, summary, id="explore-summary")
        + _histogram(
            data,
            "explore-reward",
            "reward",
            reward_bins,
            (pl.col("reward").fill_null(0.0).clip(0.0, 1.0) * 10).floor().cast(pl.Int64).clip(0, 9),
            "Final reward of every explored episode (K samples per training task), per round, in "
            "bins of 0.1 (a missing reward counts 0; a reward of 1 falls in the last bin).",
        )
        + _histogram(
            data,
            "explore-tool-calls",
            "tool calls",
            tool_bins,
            pl.col("tool_calls").fill_null(0).clip(0, MAX_TOOL_BIN).cast(pl.Int64),
            "Tool calls per explored episode, per round"
            + (f" ({MAX_TOOL_BIN} and more share the last bin)." if most > MAX_TOOL_BIN else "."),
        )
    )


def _pareto_section(data: Data) -> str:
    if not data.explore:
        return "<p>No explored trajectories yet: the Pareto front starts with round 1.</p>"
    rnd = max(data.explore)
    ref, traj = data.explore[rnd]
    frame = traj.join(
        data.selected.with_columns(selected=pl.lit(True)),
        on=["env", "task_id", "sample_idx"],
        how="left",
    ).with_columns(
        reward=pl.col("reward").fill_null(0.0),
        selected=pl.col("selected").fill_null(False),
        front=pl.col("pareto_rank") == 1,
    )
    svgs = []
    for column, label in (("tokens", "generated tokens"), ("tool_calls", "tool calls")):
        points = (
            frame.group_by("reward", column, "front", "selected")
            .agg(count=pl.len())
            .sort("front", "reward", column, "selected")
        )
        right, ticks = nice_axis(float(cast(float, points[column].max())), integer=True)
        plot = Plot(0.0, right, 0.0, max(1.0, float(cast(float, points["reward"].max()))))
        plot.axes(
            [(v, f"{v:g}") for v in ticks],
            value_ticks(plot.y1, lambda v: f"{v:.2f}"),
            f"{label} (fewer is better)",
            "reward (more is better)",
        )
        for p in points.iter_rows(named=True):
            geometry = {
                "class": "point front" if p["front"] else "point",
                "cx": plot.x(p[column]),
                "cy": plot.y(p["reward"]),
                "r": round(min(14.0, 3 + 1.5 * p["count"] ** 0.5), 2),
                "fill": FRONT if p["front"] else OTHER,
                "fill-opacity": 0.75,
                "stroke": "#000" if p["selected"] else "none",
                "stroke-width": 1.5,
            }
            marked = {
                "reward": float(p["reward"]),
                slug(column): p[column],
                "front": int(p["front"]),
                "selected": int(p["selected"]),
                "count": p["count"],
            }
            tip = f"reward {p['reward']:.3f}, {label} {p[column]}: {p['count']} trajectories"
            tip += ", Pareto front 1" if p["front"] else ""
            tip += ", in a selected GRPO group" if p["selected"] else ""
            plot.mark("circle", geometry, marked, tip)
        svgs.append(plot.svg(f"Pareto ranks: reward against {label}", x=column))
    n_front, n_selected = int(frame["front"].sum()), int(frame["selected"].sum())
    groups = html.escape(data.groups.id if data.groups is not None else "none")
    caption = (
        f"Round {rnd}: every explored trajectory by its three objectives (reward up, tool calls "
        "down, tokens down), points sized by how many trajectories share them. "
        f"<b>Red: Pareto front 1</b> among the K samples of its task ({n_front} of {len(frame)}); "
        f"black ring: in a GRPO group the pareto stage selected ({n_selected}; groups artifact "
        f"{groups}). Ranks by <code>flywheel.pareto.trajectory_ranks</code> on the explore "
        f"artifact {html.escape(ref.id)}, as the pareto stage computes them."
    )
    points = (
        frame.group_by("reward", "tool_calls", "tokens", "front", "selected")
        .agg(count=pl.len())
        .sort("front", "reward", "tool_calls", "tokens", "selected", descending=True)
    )
    values = table(
        ["reward", "tool calls", "tokens", "front 1", "selected", "trajectories"],
        [
            [
                (f"{p['reward']:.3f}", float(p["reward"])),
                (p["tool_calls"], p["tool_calls"]),
                (p["tokens"], p["tokens"]),
                ("yes" if p["front"] else "no", int(p["front"])),
                ("yes" if p["selected"] else "no", int(p["selected"])),
                (p["count"], p["count"]),
            ]
            for p in points.iter_rows(named=True)
        ],
    )
    keys = legend([("Pareto front 1", FRONT, "box"), ("other fronts", OTHER, "box")])
    return figure("pareto-front", svgs, keys, caption, values)


# -- trajectory pages ----------------------------------------------------------------------------

FACTS = (
    "task_id",
    "env",
    "split",
    "round",
    "source",
    "policy",
    "sample_idx",
    "reward",
    "success",
    "steps",
    "tool_calls",
    "tool_errors",
    "tool_ok",
    "invalid_actions",
    "tokens",
    "finish_reason",
    "seed",
    "pareto_rank",
)


def _extremes(traj: pl.DataFrame) -> dict[str, dict[str, Any]]:
    """The best (highest reward, then success, fewest tokens) and the worst (the reverse)
    trajectory; ties go to the lowest sample index, then task id."""
    keyed = traj.with_columns(
        _r=pl.col("reward").fill_null(0.0), _s=pl.col("success").fill_null(False)
    )
    keys = ["_r", "_s", "tokens", "sample_idx", "task_id"]
    best = keyed.sort(keys, descending=[True, True, False, False, False]).row(0, named=True)
    worst = keyed.sort(keys, descending=[False, False, True, False, False]).row(0, named=True)
    return {"best": best, "worst": worst}


def _fact(value: Any) -> str:
    if value is None:
        return "none"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _content(text: str, assistant: bool) -> str:
    """Escaped message text; in assistant turns each ``<tag>...</tag>`` action is marked."""
    if not assistant:
        return html.escape(text)
    out, at = [], 0
    for m in _ACTION.finditer(text):
        out.append(html.escape(text[at : m.start()]))
        out.append(
            f'<mark class="action" data-tool="{html.escape(m[1])}">{html.escape(m[0])}</mark>'
        )
        at = m.end()
    return "".join(out) + html.escape(text[at:])


def _trajectory_page(row: dict[str, Any], title: str) -> str:
    facts = [
        [(k, None), (_fact(row[k]), int(row[k]) if isinstance(row[k], bool) else row[k])]
        for k in FACTS
        if k in row
    ]
    messages = row.get("messages") or []
    # the stored ids (and log-probs) of each message: empty where the turn was not sampled
    ids = align_turn_ids(messages, row.get("turn_token_ids") or [])
    logprobs = align_turn_ids(messages, row.get("turn_logprobs") or [])
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    sampled = {i: turn for turn, i in enumerate(assistant) if ids[turn]}
    items = []
    for i, m in enumerate(messages):
        trained, text, role = bool(m["loss"]), m["content"] or "", m["role"]
        meta = f'<span class="role">{html.escape(role)}</span>'
        meta += f'<span class="loss">{"trained (loss on)" if trained else "not trained"}</span>'
        if i in sampled:
            lp = logprobs[sampled[i]]
            mean = f", mean log-prob {sum(lp) / len(lp):.3f}" if lp else ""
            meta += f'<span class="tokens">{len(ids[sampled[i]])} generated tokens{mean}</span>'
        actions = len(_ACTION.findall(text)) if role == "assistant" else 0
        data = {"data-role": role, "data-loss": str(trained).lower(), "data-actions": actions}
        cls = f"msg role-{slug(role)}" + (" trained" if trained else "")
        items.append(
            f'<li class="{cls}"{attrs(data)}><div class="meta">{meta}</div>'
            f"<pre>{_content(text, role == 'assistant')}</pre></li>"
        )
    n_trained = sum(bool(m["loss"]) for m in messages)
    body = (
        '<p><a href="../index.html">back to the report</a></p>'
        f"<h1>{html.escape(title)}</h1>{table(['field', 'value'], facts, id='facts')}"
        f"<h2>Conversation</h2><p>{len(messages)} messages, {n_trained} of them trained on "
        "(loss on) when this trajectory is a training example; actions in assistant turns are "
        f'marked.</p><ol class="messages">{"".join(items)}</ol>'
    )
    return page(title, body)


def _link(name: str, text: str, row: dict[str, Any]) -> str:
    what = f"task {row['task_id']}, sample {row['sample_idx']}, reward {_fact(row['reward'])}"
    return f'<a class="trajectory" href="{name}">{html.escape(text)}</a> ({html.escape(what)})'


def _trajectories_section(data: Data) -> tuple[str, dict[str, str]]:
    pages: dict[str, str] = {}
    body = []
    for rnd in sorted(set(data.explore) | set(data.revised)):
        traj = data.explore[rnd][1] if rnd in data.explore else None
        revised = data.revised.get(rnd)
        envs = set(traj["env"]) if traj is not None else set()
        envs |= set(revised["env"]) if revised is not None else set()
        for env in sorted(envs):
            cells: list[tuple[Any, Any]] = [(rnd, rnd), (env, None)]
            mine = traj.filter(pl.col("env") == env) if traj is not None else None
            picks = _extremes(mine) if mine is not None and len(mine) else {}
            for which in ("best", "worst"):
                if which not in picks:
                    cells.append(("none", None))
                    continue
                name = f"trajectories/round-{rnd}-{slug(env)}-{which}.html"
                title = f"Round {rnd}, {env}: the {which} explored trajectory"
                pages[name] = _trajectory_page(picks[which], title)
                cells.append((_link(name, which, picks[which]), HTML))
            rev = revised.filter(pl.col("env") == env) if revised is not None else None
            if rev is None or rev.is_empty():
                cells.append(("none", None))
            else:
                links = []
                rev = rev.with_columns(_r=pl.col("reward").fill_null(0.0))
                rev = rev.sort(["_r", "task_id", "sample_idx"], descending=[True, False, False])
                for k, row in enumerate(rev.head(MAX_REVISED).iter_rows(named=True), 1):
                    name = f"trajectories/round-{rnd}-{slug(env)}-revised-{k}.html"
                    pages[name] = _trajectory_page(
                        row, f"Round {rnd}, {env}: revised trajectory {k}"
                    )
                    links.append(_link(name, f"revised {k}", row))
                more = f" ({len(rev)} in all)" if len(rev) > MAX_REVISED else ""
                cells.append(("<br>".join(links) + more, HTML))
            body.append(cells)
    if not body:
        return "<p>No explored trajectories yet: they are written from round 1 on.</p>", pages
    note = (
        "<p>Best: the explored trajectory with the highest reward (then success, then fewest "
        "tokens); worst: the lowest. Revised: trajectories with <code>source = revision</code> "
        f"among the round's artifacts (up to {MAX_REVISED}, best first); none means the round "
        "has none.</p>"
    )
    header = ["round", "env", "best", "worst", "revised"]
    return note + table(header, body, id="trajectory-links"), pages


def _time_section(lineage: list[ArtifactRef]) -> str:
    """Seconds per round and stage, summed over the stage's artifacts in the evaluations'
    lineage, in the order the stages ran (their first artifact's ``started``)."""
    groups: dict[tuple[int, str], list[ArtifactRef]] = {}
    for ref in lineage:
        groups.setdefault((ref.round, ref.stage), []).append(ref)
    if not any("seconds" in r.manifest for r in lineage):
        return (
            "<p>None of these artifacts recorded its time (written before stages were timed).</p>"
        )
    total = sum(r.manifest.get("seconds", 0.0) for r in lineage)

    def first(key: tuple[int, str]) -> tuple[int, str]:
        refs = groups[key]
        return key[0], min(r.manifest.get("started", r.manifest.get("created", "")) for r in refs)

    body = []
    for key in sorted(groups, key=first):
        refs = groups[key]
        timed = [r.manifest["seconds"] for r in refs if "seconds" in r.manifest]
        spent = sum(timed)
        text = duration(spent) if timed else "not timed"
        if len(timed) < len(refs) and timed:
            text += f" + {len(refs) - len(timed)} not timed"
        if any(r.manifest.get("resumed") for r in refs):
            text += " (resumed)"
        share = spent / total if total else 0.0
        body.append(
            [
                (key[0], key[0]),
                (key[1], None),
                (len(refs), len(refs)),
                (text, spent),
                (f"{100 * share:.0f}%", share),
            ]
        )
    note = (
        f"<p>{duration(total)} in all: each artifact's own time, from its stage opening it to its "
        "commit (a cache hit counts the time of the run that wrote it). Resumed: a run took over "
        "the shards or train state of an interrupted one, whose time is not counted.</p>"
    )
    return note + table(["round", "stage", "artifacts", "time", "share"], body, id="stage-times")


# -- assembling and writing ----------------------------------------------------------------------


def _evaluations_table(rows: list[dict[str, Any]]) -> str:
    body = []
    for row in rows:
        cells: list[tuple[Any, Any]] = []
        for col in COLUMNS:
            raw = row.get("success_rate" if col == "success" else col)
            cells.append((_cell(row, col), raw if col not in ("round", "policy", "env") else None))
        body.append([*cells, (row["eval_id"], None)])
    return table([*COLUMNS, "eval artifact"], body, id="evaluations")


def _build(store: Store, every: list[dict[str, Any]], note: str | None = None) -> dict[str, str]:
    """The pages by relative path; ``every`` is what ``flywheel report`` prints, ``note`` the
    line that says the run has not finished (under the title)."""
    rows = [r for r in every if "success_rate" in r]
    data = _load(store, rows)
    envs = sorted({r["env"] for r in rows})
    rounds = sorted({r["round"] for r in rows})
    trajectories, pages = _trajectories_section(data)
    title = f"flywheel report: {store.run}"
    text = html.escape(format_table(every))
    body = (
        f"<h1>{html.escape(title)}</h1><p>Run <b>{html.escape(store.run)}</b> in "
        f"{html.escape(store.root_url)}: {len(rows)} evaluations, rounds {rounds[0]} to "
        f"{rounds[-1]}, envs {html.escape(', '.join(envs))}.</p>"
        + (f'<p class="note" id="unfinished">{html.escape(note)}</p>' if note else "")
        + '<h2 id="success">Held-out success per round</h2>'
        + "".join(_success_plot(rows, env) for env in envs)
        + '<h2 id="evaluation-table">Evaluations: the numbers of <code>flywheel report</code></h2>'
        + _evaluations_table(rows)
        + "<details open><summary>as <code>flywheel report</code> prints it</summary>"
        + f'<pre class="report" id="report-text">{text}</pre></details>'
        + '<h2 id="difficulty">Held-out success per task difficulty</h2>'
        + "".join(_difficulty_plot(data, env) for env in envs)
        + '<h2 id="explore">Explore: rewards and tool calls</h2>'
        + _explore_section(data)
        + '<h2 id="pareto">Pareto ranks of the last round</h2>'
        + _pareto_section(data)
        + '<h2 id="trajectories">Trajectories</h2>'
        + trajectories
        + '<h2 id="time">Where the time went</h2>'
        + _time_section(data.lineage)
    )
    return {"index.html": page(title, body), **pages}


def _check_target(out: Path) -> None:
    """A one-line ValueError unless ``out`` can become the report folder: missing, empty or an
    earlier report, in a folder we can write to."""
    if out.exists():
        if not out.is_dir():
            raise ValueError(f"report path {out} is a file, not a folder")
        if any(out.iterdir()) and not _is_report(out):
            raise ValueError(
                f"report path {out} is a folder that holds no flywheel report: refusing to replace it"
            )
    existing = out.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"report path {out} is inside {existing}, which is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(
            f"report path {out}: cannot write to {existing} (read-only or no permission)"
        )


def _is_report(folder: Path) -> bool:
    try:
        head = (folder / "index.html").read_text(encoding="utf-8")[:1000]
    except (OSError, UnicodeDecodeError):
        return False
    return f'<meta name="generator" content="{GENERATOR}">' in head


def _write_folder(out: Path, pages: dict[str, str]) -> None:
    """Write ``pages`` into a hidden sibling of ``out``, then rename it into place."""
    missing = []
    folder = out.parent
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    token = secrets.token_hex(4)
    tmp, old = out.parent / f".tmp-{out.name}-{token}", out.parent / f".old-{out.name}-{token}"
    try:
        tmp.mkdir(parents=True)
        for name, text in pages.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_text(text, encoding="utf-8")
        if out.exists():  # an earlier report (or an empty folder): swap it out
            out.rename(old)
            try:
                tmp.rename(out)
            except BaseException:
                old.rename(out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for made in missing:  # a failed write leaves nothing behind
            if made.is_dir() and not any(made.iterdir()):
                made.rmdir()
        raise
