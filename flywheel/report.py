"""Held-out metrics of every evaluated policy, side by side.

``collect`` reads the evaluations of the last ``flywheel run`` (recorded in ``flywheel.json``
under the run's folder) or, when there is none, every eval artifact in the store.

    flywheel report          # a table
    flywheel report --json   # one object per policy and env
"""

from __future__ import annotations

import json
from typing import Any

from flywheel.store import ArtifactError, Store

STATE_FILE = "flywheel.json"
COLUMNS = (
    "round",
    "policy",
    "env",
    "success_rate",
    "avg_reward",
    "n_tasks",
    "avg_steps",
    "avg_tool_calls",
    "tool_success",
    "reasoning_tokens",
    "efficiency",
)


def collect(store: Store) -> list[dict[str, Any]]:
    state_path = f"{store.base}/{STATE_FILE}"
    if store.fs.exists(state_path):
        with store.fs.open(state_path, "r") as fh:
            ids = json.load(fh).get("evaluations", [])
        refs = [store.get(i) for i in ids]
    else:
        refs = store.list(stage="evaluate")
    rows = []
    for ref in refs:
        if ref.kind != "eval":
            raise ArtifactError(f"artifact {ref.id} is not an eval artifact")
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
            rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no evaluated policies yet (run `flywheel run`)"
    header = [c for c in COLUMNS]
    lines = [header]
    for row in rows:
        cells = []
        for col in header:
            value = row.get(col, "")
            cells.append(f"{value:.3f}" if isinstance(value, float) else str(value))
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)) for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)
