"""Evaluation metrics of ALGORITHMS.md, computed per env with polars over eval rows.

- n_tasks (distinct tasks) and n_episodes (explore samples K episodes per task, evaluate one)
- success_rate, avg_reward (sum / number of episodes; a missing reward counts 0)
- avg_steps, avg_tool_calls, reasoning_tokens (generated assistant tokens, tool output excluded)
- tool_success: share of tool results that are non-empty and not an error or timeout
- efficiency: mean over tasks of acc / tool_calls (acc when there was no tool call)
"""

from __future__ import annotations

import polars as pl


def summarize(frame: pl.DataFrame) -> dict[str, dict[str, float]]:
    """Metrics per env; ``frame`` has the eval (or trajectory) columns."""
    if frame.is_empty():
        return {}
    acc = pl.col("success").cast(pl.Float64)
    per_env = (
        frame.group_by("env")
        .agg(
            n_tasks=pl.col("task_id").n_unique(),
            n_episodes=pl.len(),  # explore samples K per task; evaluate one
            success_rate=acc.mean(),
            avg_reward=pl.col("reward").fill_null(0.0).sum() / pl.len(),
            avg_steps=pl.col("steps").mean(),
            avg_tool_calls=pl.col("tool_calls").mean(),
            reasoning_tokens=pl.col("tokens").mean(),
            tool_success=pl.when(pl.col("tool_calls").sum() > 0)
            .then(pl.col("tool_ok").sum() / pl.col("tool_calls").sum())
            .otherwise(0.0),
            efficiency=pl.when(pl.col("tool_calls") > 0)
            .then(acc / pl.col("tool_calls"))
            .otherwise(acc)
            .mean(),
        )
        .sort("env")
    )
    out: dict[str, dict[str, float]] = {}
    for row in per_env.iter_rows(named=True):
        env = row.pop("env")
        out[env] = {k: float(v) for k, v in row.items()}
    return out


def flatten(summary: dict[str, dict[str, float]]) -> dict[str, float]:
    """``{"arith": {"success_rate": .5}}`` -> ``{"arith/success_rate": .5}`` (MLflow metric names)."""
    return {f"{env}/{k}": v for env, metrics in summary.items() for k, v in metrics.items()}
