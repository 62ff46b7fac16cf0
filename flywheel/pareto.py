"""Mining explored trajectories: ETO contrastive pairs, ET-Agent group-wise Pareto selection and a
per-trajectory Pareto rank (ALGORITHMS.md, "Exploration rollouts and contrastive pairs" and
"Group-wise Pareto filtering and curriculum"). Pure functions over polars frames with the
trajectories columns; no I/O (stages/pareto.py reads and writes the artifacts).

    ranks = trajectory_ranks(explore)                     # per row, among the K samples of its task
    explore = explore.with_columns(pareto_rank=pl.Series(ranks))
    pairs = build_pairs(explore, expert, margin=0.0)      # expert and best_worst pairs
    groups = select_groups(explore, budget=1024)          # one row per group; `selected` marks the pick

Everything is vectorised: the Python loops run over objectives, group sizes, Pareto levels (at
most K) or distinct (x1, x2) points, never over rows. ``benchmarks/bench_pareto.py`` times it
against a plain-Python version of the same selection.
"""

from __future__ import annotations

import bisect

import numpy as np
import polars as pl

from flywheel.trajectory import stored_span

GROUP = ["env", "task_id"]
# The prompt of a pair is the chosen side's opening: every message before its first trained
# assistant turn (loss true). For the built-in envs that is the AgentGym start (instruction,
# "Ok.", first observation); a suite or imported data with another opening needs no setting.
OPENING = "_opening"
_DENSE_CELLS = 1 << 24  # booleans per block of the pairwise-dominance tensor (bounds memory)


# -- non-dominated sorting and crowding (every objective is maximised) -----------------------------


def _dense_fronts(points: np.ndarray) -> np.ndarray:
    """Front (1-based) of every point of T independent sets of n points: ``points`` is (T, n, M).

    Pairwise dominance as one (T, n, n) tensor, then peel: a level takes the points that nothing
    left dominates. At most n levels, each a vectorised pass over all T sets at once."""
    t, n, m = points.shape
    fronts = np.zeros((t, n), np.int32)
    step = max(1, _DENSE_CELLS // max(1, n * n * m))
    for lo in range(0, t, step):
        p = points[lo : lo + step]
        a, b = p[:, :, None, :], p[:, None, :, :]
        dominates = (a >= b).all(-1) & (a > b).any(-1)  # [s, i, j]: i dominates j
        remaining = np.ones(p.shape[:2], bool)
        out = fronts[lo : lo + step]
        level = 0
        while remaining.any():
            level += 1
            dominated = (dominates & remaining[:, :, None]).any(axis=1)
            front = remaining & ~dominated
            out[front] = level
            remaining &= ~front
    return fronts


def nondominated_fronts(points: np.ndarray) -> np.ndarray:
    """Generic NSGA-II fronts (1 = non-dominated) of (N, M) points, O(M N^2) time and memory.

    For small inputs and cross-checks; ``fronts_2d`` is the scalable one for two objectives."""
    points = np.asarray(points, float)
    if len(points) == 0:
        return np.zeros(0, np.int32)
    return _dense_fronts(points[None])[0]


def fronts_2d(x1: np.ndarray, x2: np.ndarray) -> np.ndarray:
    """NSGA-II fronts of points (x1, x2), both maximised, in O(n log n).

    Identical points always share a front, so sort only the distinct ones (the group objectives
    take few distinct values: the loop is short) and sweep them by x1 descending, then x2
    descending. Every point seen before p has x1 >= p.x1, so a front dominates p iff the
    largest x2 in it is >= p.x2; within a front x2 grows along the sweep, so that is the
    front's latest x2, and the latest x2s fall from front to front. p goes to the first front
    whose latest x2 is below p.x2: a binary search."""
    x1 = np.asarray(x1, float)
    x2 = np.asarray(x2, float)
    if len(x1) == 0:
        return np.zeros(0, np.int32)
    distinct, inverse = np.unique(np.stack([x1, x2], axis=1), axis=0, return_inverse=True)
    latest: list[float] = []  # -(latest x2) of each front: non-decreasing, so bisect works
    front_of = np.empty(len(distinct), np.int32)
    for i in range(len(distinct) - 1, -1, -1):  # np.unique sorts ascending: walk it backwards
        key = -distinct[i, 1]
        f = bisect.bisect_right(latest, key)
        if f == len(latest):
            latest.append(key)
        else:
            latest[f] = key
        front_of[i] = f + 1
    return front_of[inverse.reshape(-1)]


def crowding_distance(points: np.ndarray, fronts: np.ndarray) -> np.ndarray:
    """NSGA-II crowding distance of each point within its front.

    Per objective, sort the front; the two ends get infinity, an interior point the gap between
    its neighbours divided by the front's range of that objective (0 when the range is 0);
    sum over objectives. Ties in an objective keep the input order, so the result is
    deterministic."""
    points = np.asarray(points, float)
    fronts = np.asarray(fronts)
    n = len(points)
    distance = np.zeros(n)
    if n == 0:
        return distance
    index = np.arange(n)
    for k in range(points.shape[1]):
        order = np.lexsort((index, points[:, k], fronts))
        f, v = fronts[order], points[order, k]
        first = np.r_[True, f[1:] != f[:-1]]
        last = np.r_[f[1:] != f[:-1], True]
        segment = np.cumsum(first) - 1
        span = (v[last] - v[first])[segment]
        gap = np.r_[v[1:], v[-1]] - np.r_[v[0], v[:-1]]
        part = np.divide(gap, span, out=np.zeros(n), where=span > 0)
        part[first | last] = np.inf
        distance[order] += part
    return distance


def select_by_fronts(
    points: np.ndarray, budget: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fronts, crowding, order): ``order[:budget]`` is the selection.

    Sorting by (front, crowding descending, input order) and taking a prefix is exactly
    "fill front by front; cut the overflowing front by crowding, boundary points first"."""
    points = np.asarray(points, float)
    if points.shape[1] == 2:
        fronts = fronts_2d(points[:, 0], points[:, 1])
    else:
        fronts = nondominated_fronts(points)
    crowding = crowding_distance(points, fronts)
    order = np.lexsort((np.arange(len(points)), -crowding, fronts))
    return fronts, crowding, order[: len(order) if budget is None else budget]


# -- per-trajectory Pareto rank --------------------------------------------------------------------


def trajectory_ranks(traj: pl.DataFrame) -> np.ndarray:
    """Pareto front (1 = best) of each row among the rows of its task (env, task_id) over
    (reward up, tool calls down, tokens down); aligned with ``traj``'s rows.

    Scope is the task: rewards are comparable only within a task. Rows are grouped by group
    size, so the K samples of every task of one size form a dense (tasks, K, 3) block."""
    if traj.is_empty():
        return np.zeros(0, np.int32)
    f = (
        traj.select(
            *GROUP,
            pl.col("reward").fill_null(0.0).cast(pl.Float64),
            (-pl.col("tool_calls").fill_null(0)).cast(pl.Float64),
            (-pl.col("tokens").fill_null(0)).cast(pl.Float64),
        )
        .with_row_index("_row")
        .with_columns(_size=pl.len().over(GROUP))
        .sort(["_size", *GROUP])
    )
    rows = f["_row"].to_numpy()
    sizes = f["_size"].to_numpy()
    objectives = f.select("reward", "tool_calls", "tokens").to_numpy()
    ranks = np.zeros(len(traj), np.int32)
    bounds = np.flatnonzero(np.r_[True, sizes[1:] != sizes[:-1], True])
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        k = int(sizes[lo])
        ranks[rows[lo:hi]] = _dense_fronts(objectives[lo:hi].reshape(-1, k, 3)).reshape(-1)
    return ranks


# -- ET-Agent group-wise selection -------------------------------------------------------------


def group_stats(traj: pl.DataFrame, *, graded_threshold: float = 0.75) -> pl.DataFrame:
    """One row per group (the rollouts of one task): n, x1, x2, reward stats, the post-filter.

    x1 and x2 are *population* variances (divide by n): they measure the spread of the group
    itself, not an estimate of a wider population, and a group of one has spread 0. They are
    computed from integer sums, ``(n*sum(x^2) - sum(x)^2) / n^2``, so equal groups get
    bit-identical values whatever the row order (fronts compare them exactly).

    ``eligible`` is the post-filter: a binary-reward group (every reward 0 or 1) needs a success
    and a failure; a graded group needs a reward >= ``graded_threshold`` and one below it. Flat
    groups (all rewards equal) never pass: their GRPO advantages are all zero."""
    reward = pl.col("reward").fill_null(0.0).cast(pl.Float64)
    calls = pl.col("tool_calls").fill_null(0).cast(pl.Int64)
    groups = traj.group_by(GROUP).agg(
        n=pl.len().cast(pl.Int64),
        _sum=calls.sum(),
        _sum2=(calls * calls).sum(),
        _wins=pl.col("success").fill_null(False).cast(pl.Int64).sum(),
        mean_reward=reward.mean(),
        min_reward=reward.min(),
        max_reward=reward.max(),
        binary=reward.is_in([0.0, 1.0]).all(),
        sample_idx=pl.col("sample_idx").sort(),
    )
    n = pl.col("n")
    binary_ok = (pl.col("min_reward") == 0.0) & (pl.col("max_reward") == 1.0)
    graded_ok = (pl.col("max_reward") >= graded_threshold) & (
        pl.col("min_reward") < graded_threshold
    )
    return (
        groups.with_columns(
            x1=(n * pl.col("_sum2") - pl.col("_sum") ** 2).cast(pl.Float64)
            / (n * n).cast(pl.Float64),
            x2=(pl.col("_wins") * (n - pl.col("_wins"))).cast(pl.Float64)
            / (n * n).cast(pl.Float64),
            eligible=pl.when(pl.col("binary")).then(binary_ok).otherwise(graded_ok),
        )
        .drop("_sum", "_sum2", "_wins")
        .sort(GROUP)
    )


def select_groups(
    traj: pl.DataFrame, *, budget: int | None, graded_threshold: float = 0.75
) -> pl.DataFrame:
    """``group_stats`` plus ``front``, ``crowding`` and ``selected``; eligible groups first, in
    selection order.

    The post-filter runs *before* the sort: a group it drops is useless to GRPO whatever its
    front, and if it stayed in it could push useful groups to later fronts and take budget that
    the post-filter would then leave empty. So fronts rank eligible groups only, and ``budget``
    counts groups that GRPO will actually train on (None: every eligible group). All envs share
    one sort and one budget."""
    stats = group_stats(traj, graded_threshold=graded_threshold)
    eligible = stats.filter(pl.col("eligible"))
    fronts, crowding, chosen = select_by_fronts(eligible.select("x1", "x2").to_numpy(), budget)
    position = np.full(len(eligible), len(eligible), np.int64)
    position[chosen] = np.arange(len(chosen))
    eligible = (
        eligible.with_columns(
            front=pl.Series(fronts, dtype=pl.Int32),
            crowding=pl.Series(crowding, dtype=pl.Float64),
            selected=pl.Series(position < len(chosen)),
            _order=pl.Series(position),
        )
        .sort(
            ["_order", "front", "crowding", *GROUP], descending=[False, False, True, False, False]
        )
        .drop("_order")
    )
    rest = stats.filter(~pl.col("eligible")).with_columns(
        front=pl.lit(None, pl.Int32), crowding=pl.lit(None, pl.Float64), selected=pl.lit(False)
    )
    return pl.concat([eligible, rest])


# -- ETO contrastive pairs ---------------------------------------------------------------------

# What each side of a pair carries. Pairs are first chosen as (chosen row, rejected row) indices
# into one table of explored and expert rows, sorted, and only then are the nested columns
# (messages, token ids) gathered: once per side, never joined or sorted.
_SIDE = ["policy", "messages", "reward", "source", "sample_idx", "turn_token_ids"]


def _gold(expert: pl.DataFrame) -> pl.DataFrame:
    """One expert row per task: the best reward (a missing one counts 1.0), then the shortest."""
    return (
        expert.with_columns(
            reward=pl.col("reward").fill_null(1.0).cast(pl.Float64), sample_idx=pl.lit(-1, pl.Int32)
        )
        .sort(
            [*GROUP, "reward", pl.col("messages").list.len()],
            descending=[False, False, True, False],
        )
        .group_by(GROUP, maintain_order=True)
        .first()
    )


def _expert_picks(explore: pl.DataFrame, gold: pl.DataFrame, offset: int) -> pl.DataFrame:
    """Every explored sample against its task's expert: the higher reward is chosen; ties none."""
    mine = explore.select(*GROUP, "reward").with_row_index("_row")
    theirs = gold.select(*GROUP, "reward").with_row_index("_row", offset=offset)
    joined = mine.join(theirs, on=GROUP, suffix="_gold").filter(
        pl.col("reward") != pl.col("reward_gold")
    )
    explored_wins = pl.col("reward") > pl.col("reward_gold")
    return joined.select(
        *GROUP,
        kind=pl.lit("expert"),
        chosen=pl.when(explored_wins).then(pl.col("_row")).otherwise(pl.col("_row_gold")),
        rejected=pl.when(explored_wins).then(pl.col("_row_gold")).otherwise(pl.col("_row")),
    )


def _best_worst_picks(
    explore: pl.DataFrame, margin: float, prefer_pareto_rank: bool
) -> pl.DataFrame:
    """The best vs the worst sample of each task when their rewards differ by more than margin.

    best: highest reward, [lowest Pareto rank], fewest tokens, lowest sample_idx;
    worst: lowest reward, [highest Pareto rank], most tokens, lowest sample_idx."""
    rank = ["pareto_rank"] if prefer_pareto_rank else []
    keys = ["reward", *rank, "tokens", "sample_idx"]
    row = pl.col("_row")
    return (
        explore.with_row_index("_row")
        .group_by(GROUP)
        .agg(
            chosen=row.sort_by(keys, descending=[True, *[False] * len(rank), False, False]).first(),
            rejected=row.sort_by(
                keys, descending=[False, *[True] * len(rank), True, False]
            ).first(),
            gap=pl.col("reward").max() - pl.col("reward").min(),
        )
        .filter(pl.col("gap") > margin)
        .select(*GROUP, kind=pl.lit("best_worst"), chosen="chosen", rejected="rejected")
    )


def opening_length(messages: pl.Expr) -> pl.Expr:
    """Messages before the first trained assistant turn (all of them when none is trained)."""
    trained = messages.list.eval(
        (pl.element().struct.field("role") == "assistant")
        & pl.element().struct.field("loss").fill_null(False)
    )
    first = trained.list.arg_max().cast(pl.Int64)
    return pl.when(trained.list.any()).then(first).otherwise(messages.list.len().cast(pl.Int64))


def _cut(pairs: pl.DataFrame, side: str, limit: pl.Expr) -> pl.DataFrame:
    """Cut ``<side>_messages`` after its last assistant turn before message ``limit``: adds the
    continuation after the prompt (``_<side>``), its sampled turn ids (``_<side>_ids``) and
    whether it has an assistant turn at all (``_<side>_ok``).

    The continuation's ids are the stored lists of its assistant turns, found by the
    trajectory rule (``flywheel.trajectory.stored_span``) evaluated on whole columns. Only
    native list kernels (head, sum, reverse, arg_max, slice): no per-row expression evaluation."""
    msgs = pl.col(f"{side}_messages")
    ids = pl.col(f"{side}_turn_token_ids")
    is_assistant = msgs.list.eval((pl.element().struct.field("role") == "assistant").cast(pl.Int8))
    opening = pl.col(OPENING)
    marks = pairs.select(
        head=is_assistant.list.head(limit),
        total=is_assistant.list.sum().cast(pl.Int64),
        in_prompt=is_assistant.list.head(opening).list.sum().cast(pl.Int64),
        stored=ids.list.len().cast(pl.Int64),
    )
    head = pl.col("head")
    kept = head.list.sum().cast(pl.Int64)  # assistant turns before message `limit`
    # one past the last assistant turn in the head (meaningless when kept == 0: dropped then)
    end = head.list.len().cast(pl.Int64) - head.list.reverse().list.arg_max().cast(pl.Int64)
    in_prompt = pl.col("in_prompt")
    start, stop = stored_span(
        pl.col("total"), pl.col("stored"), in_prompt, kept, maximum=pl.max_horizontal
    )
    cuts = marks.select(_end=end, _start=start, _length=stop - start, _ok=kept > in_prompt)
    end, start, length = pl.col("_end"), pl.col("_start"), pl.col("_length")
    return (
        pairs.hstack(cuts)
        .with_columns(
            msgs.list.slice(opening, pl.max_horizontal(end - opening, 0)).alias(f"_{side}"),
            ids.list.slice(start, length).alias(f"_{side}_ids"),
            pl.col("_ok").alias(f"_{side}_ok"),
        )
        .drop(cuts.columns)
    )


def build_pairs(
    explore: pl.DataFrame,
    expert: pl.DataFrame,
    *,
    margin: float = 0.0,
    expert_pairs: bool = True,
    best_worst_pairs: bool = True,
    cut_extra_messages: int = 10,
    prefer_pareto_rank: bool = True,
) -> pl.DataFrame:
    """ETO pairs (kind ``expert``) and ours (kind ``best_worst``): the pairs contract's columns
    except ``round`` and the reference log-probs, which the stage adds.

    A missing explored reward counts 0; a missing expert reward counts 1.0 (``r_gold`` unknown).
    The rejected side is cut to at most len(chosen trajectory) + ``cut_extra_messages`` messages
    (ETO's len(expert) + 10 when the expert is chosen; the same rule for the other pairs). Both
    continuations are then cut back to end on an assistant turn; a pair where either side has
    no assistant turn after the prompt is dropped. The prompt is the chosen side's opening, every
    message before its first trained assistant turn (the same for both sides: for the built-in
    envs instruction, ``Ok.``, first observation). ``policy`` is the explored side's (the
    chosen one's when both are explored)."""
    explore = explore.with_columns(pl.col("reward").fill_null(0.0).cast(pl.Float64))
    if prefer_pareto_rank and "pareto_rank" not in explore.columns:
        explore = explore.with_columns(
            pareto_rank=pl.Series(trajectory_ranks(explore), dtype=pl.Int32)
        )
    gold = _gold(expert)
    n = len(explore)
    # one chunk: polars gathers from a multi-chunk nested column several times slower
    sides = pl.concat([explore.select(*GROUP, *_SIDE), gold.select(*GROUP, *_SIDE)], rechunk=True)
    picks = []
    if expert_pairs:
        picks.append(_expert_picks(explore, gold, offset=n))
    if best_worst_pairs or not picks:  # an empty frame of the right columns when both are off
        picks.append(
            _best_worst_picks(
                explore if best_worst_pairs else explore.clear(), margin, prefer_pareto_rank
            )
        )
    pairs = pl.concat([p.with_columns(pl.col("chosen", "rejected").cast(pl.Int64)) for p in picks])
    sample = sides["sample_idx"]
    pairs = pairs.sort(
        [*GROUP, "kind", sample.gather(pairs["chosen"]), sample.gather(pairs["rejected"])]
    )
    gathered = [
        sides.select(pl.col(c).gather(pairs[side]).alias(f"{side}_{c}") for c in _SIDE)
        for side in ("chosen", "rejected")
    ]
    pairs = pl.concat([pairs, *gathered], how="horizontal")
    whole = pl.col("chosen_messages").list.len().cast(pl.Int64)
    pairs = pairs.with_columns(opening_length(pl.col("chosen_messages")).alias(OPENING))
    pairs = _cut(pairs, "chosen", whole)
    pairs = _cut(pairs, "rejected", whole + cut_extra_messages)
    pairs = pairs.filter(pl.col("_chosen_ok") & pl.col("_rejected_ok"))
    return pairs.select(
        *GROUP,
        policy=pl.when(pl.col("chosen") < n).then("chosen_policy").otherwise("rejected_policy"),
        kind="kind",
        prompt=pl.col("chosen_messages").list.head(pl.col(OPENING)),
        chosen="_chosen",
        rejected="_rejected",
        chosen_reward="chosen_reward",
        rejected_reward="rejected_reward",
        chosen_source="chosen_source",
        rejected_source="rejected_source",
        chosen_sample_idx=pl.col("chosen_sample_idx").cast(pl.Int32),
        rejected_sample_idx=pl.col("rejected_sample_idx").cast(pl.Int32),
        chosen_turn_token_ids="_chosen_ids",
        rejected_turn_token_ids="_rejected_ids",
    )
