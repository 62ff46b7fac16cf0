"""Stage ``pareto``: mine one round's explored trajectories into DPO pairs (ETO pairs against the
expert, plus best-vs-worst of the K samples) and GRPO groups (ET-Agent group-wise Pareto
selection), each row carrying its trajectory's Pareto rank. The algorithms are in
flywheel/pareto.py; this module reads, writes and summarises.

    flywheel stage pareto --round 1

Two artifacts, one stage: both live under ``round-<r>/pareto/`` with ids ``pareto-<hash>``, so
module, config section, task and folder keep the one name ``pareto``. Each writer hashes the
artifact's kind and only the config fields that shape it (``PAIR_FIELDS`` / ``GROUP_FIELDS``):
the ids always differ, and changing the group budget leaves the pairs (and the dpo run that
reads them) a cache hit. The groups artifact also holds ``groups.png``: every group's (x1, x2),
the post-filter, the selection and front 1 (the tracker logs PNGs it finds in an artifact
folder). Summary metrics: pairs, pairs_per_task, pairs by kind, mean_reward_gap; groups,
groups_eligible, groups_selected, trajectories_selected, front_1..front_3, fronts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import numpy as np
import polars as pl
import pyarrow as pa

from data_contracts import groups as groups_contract
from data_contracts import pairs as pairs_contract
from flywheel.config import Config, ParetoConfig  # noqa: F401 - re-exported for callers
from flywheel.pareto import GROUP, build_pairs, select_groups, trajectory_ranks
from flywheel.progress import say
from flywheel.store import ArtifactRef, ArtifactWriter, Store

PLOT = "groups.png"
PAIR_FIELDS = {
    "margin",
    "expert_pairs",
    "best_worst_pairs",
    "prefer_pareto_rank",
    "cut_extra_messages",
    "shard_rows",
}
GROUP_FIELDS = {"budget", "graded_threshold", "shard_rows"}


def artifact_config(cfg: Config, artifact: str) -> dict[str, Any]:
    """What each artifact's id hashes: its kind and only the pareto fields that shape it, so a
    new group budget leaves the pairs (and the dpo run that reads them) a cache hit."""
    fields = PAIR_FIELDS if artifact == "pairs" else GROUP_FIELDS
    return {"artifact": artifact, "pareto": cfg.pareto.model_dump(include=fields)}


def run(
    cfg: Config,
    store: Store,
    explore: ArtifactRef,
    expert: ArtifactRef,
    *,
    round: int,
    force: bool = False,
) -> tuple[ArtifactRef, ArtifactRef]:
    pc: ParetoConfig = cfg.pareto
    inputs = [explore.id, expert.id]
    w_pairs = store.writer(
        "pairs",
        stage="pareto",
        round=round,
        inputs=inputs,
        force=force,
        config=artifact_config(cfg, "pairs"),
    )
    w_groups = store.writer(
        "groups",
        stage="pareto",
        round=round,
        inputs=inputs,
        force=force,
        config=artifact_config(cfg, "groups"),
    )
    if w_pairs.cached and w_groups.cached:
        return w_pairs.ref, w_groups.ref
    traj = cast(pl.DataFrame, pl.from_arrow(store.read(explore)))
    traj = traj.with_columns(
        reward=pl.col("reward").fill_null(0.0),
        pareto_rank=pl.Series(trajectory_ranks(traj), dtype=pl.Int32),
    )
    if not w_pairs.cached:
        gold = cast(pl.DataFrame, pl.from_arrow(store.read(expert)))
        pairs = build_pairs(
            traj,
            gold,
            margin=pc.margin,
            expert_pairs=pc.expert_pairs,
            best_worst_pairs=pc.best_worst_pairs,
            cut_extra_messages=pc.cut_extra_messages,
            prefer_pareto_rank=pc.prefer_pareto_rank,
        )
        n_tasks = traj.select(pl.struct(GROUP).n_unique()).item()
        _write(w_pairs, _pairs_table(pairs, round), pc.shard_rows)
        w_pairs.commit(summary=_pairs_summary(pairs, n_tasks))
        say(f"pareto: {len(pairs)} pairs over {n_tasks} tasks")
    if not w_groups.cached:
        groups = select_groups(traj, budget=pc.budget, graded_threshold=pc.graded_threshold)
        table = _groups_table(traj, groups, round)
        _write(w_groups, table, pc.shard_rows)
        _plot(groups, w_groups.local_dir() / PLOT)
        summary = _groups_summary(groups, table.num_rows)
        w_groups.commit(summary=summary)
        say(
            f"pareto: {summary['groups_selected']} of {summary['groups_eligible']} eligible groups selected"
        )
    return w_pairs.ref, w_groups.ref


def _write(writer: ArtifactWriter, table: pa.Table, shard_rows: int) -> None:
    # Arrow slices, not Python rows: a million-row round stays columnar end to end.
    for i, start in enumerate(range(0, table.num_rows, shard_rows)):
        if not writer.has_shard(i):  # the result is deterministic: a crashed run's shards hold
            writer.write_shard(i, table.slice(start, shard_rows))


def _to_contract(frame: pl.DataFrame, schema: pa.Schema) -> pa.Table:
    # polars writes large_list/large_string; the contracts declare list/string.
    return frame.select(schema.names).to_arrow().cast(schema)


def _pairs_table(pairs: pl.DataFrame, round: int) -> pa.Table:
    frame = pairs.with_columns(round=pl.lit(round, pl.Int32))
    return _to_contract(frame, pairs_contract.SCHEMA)


def _groups_table(traj: pl.DataFrame, groups: pl.DataFrame, round: int) -> pa.Table:
    picked = (
        groups.filter(pl.col("selected"))
        .with_row_index("_order")
        .select(
            *GROUP,
            "_order",
            group_front=pl.col("front"),
            group_crowding=pl.col("crowding"),
            group_x1=pl.col("x1"),
            group_x2=pl.col("x2"),
            group_size=pl.col("n").cast(pl.Int32),
            group_mean_reward=pl.col("mean_reward"),
        )
    )
    rows = (
        traj.join(picked, on=GROUP)
        .sort(["_order", "sample_idx"])
        .with_columns(round=pl.lit(round, pl.Int32), success=pl.col("success").fill_null(False))
    )
    return _to_contract(rows, groups_contract.SCHEMA)


def _pairs_summary(pairs: pl.DataFrame, n_tasks: int) -> dict[str, float]:
    kinds = dict(pairs.group_by("kind").len().iter_rows())
    gap = (
        cast(float | None, (pairs["chosen_reward"] - pairs["rejected_reward"]).mean())
        if len(pairs)
        else 0.0
    )
    return {
        "pairs": len(pairs),
        "pairs_per_task": len(pairs) / max(n_tasks, 1),
        **{f"pairs_{kind}": kinds.get(kind, 0) for kind in pairs_contract.KINDS},
        "mean_reward_gap": float(gap or 0.0),
    }


def _groups_summary(groups: pl.DataFrame, rows: int) -> dict[str, float]:
    eligible = groups.filter(pl.col("eligible"))
    selected = eligible.filter(pl.col("selected"))
    fronts = dict(eligible.group_by("front").len().iter_rows())
    return {
        "groups": len(groups),
        "groups_eligible": len(eligible),
        "groups_selected": len(selected),
        "trajectories_selected": rows,
        **{f"front_{f}": fronts.get(f, 0) for f in (1, 2, 3)},
        "fronts": len(fronts),
        "selected_mean_reward": float(cast(float | None, selected["mean_reward"].mean()) or 0.0),
    }


def _plot(groups: pl.DataFrame, path: Path) -> None:
    """Scatter of every group's (x1, x2): filtered out, eligible, selected; front 1 ringed.

    Groups repeat the same few (x1, x2) values, so each distinct point is drawn once, sized by
    its count: fast for 250k groups and readable."""
    from matplotlib.figure import Figure  # heavy import; the Agg canvas, no pyplot state

    kind = (
        pl.when(pl.col("selected"))
        .then(pl.lit("selected"))
        .when(pl.col("eligible"))
        .then(pl.lit("eligible, not selected"))
        .otherwise(pl.lit("filtered out"))
    )
    points = (
        groups.with_columns(kind=kind, first=pl.col("front") == 1)
        .group_by("x1", "x2", "kind", "first")
        .len()
    )
    fig = Figure(figsize=(6.4, 4.8))
    ax = fig.subplots()
    styles = {"filtered out": "#bbbbbb", "eligible, not selected": "#4c72b0", "selected": "#dd4444"}
    for label, color in styles.items():
        part = points.filter(pl.col("kind") == label)
        if not part.is_empty():
            ax.scatter(
                part["x1"],
                part["x2"],
                s=_size(part["len"]),
                c=color,
                alpha=0.75,
                linewidths=0,
                label=f"{label} ({int(part['len'].sum())})",
            )
    first = points.filter(pl.col("first").fill_null(False))
    if not first.is_empty():
        ax.scatter(
            first["x1"],
            first["x2"],
            s=_size(first["len"]) * 2.5,
            facecolors="none",
            edgecolors="black",
            linewidths=1.2,
            label=f"Pareto front 1 ({int(first['len'].sum())})",
        )
    ax.set_xlabel("x1 = variance of tool calls in the group")
    ax.set_ylabel("x2 = variance of success in the group")
    ax.set_title("GRPO groups: the post-filter, the fronts and the selection")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _size(counts: pl.Series) -> np.ndarray:
    return 12 + 8 * np.sqrt(counts.to_numpy())
