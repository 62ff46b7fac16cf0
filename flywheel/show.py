"""Episodes of an artifact in the terminal: ``flywheel show ARTIFACT``.

Reads a trajectories, eval or groups artifact (one episode per row) or a pairs artifact (the
shared prompt, then the chosen and the rejected continuation) and prints, per episode, a header
(task, env, source, sample, reward, success, finish reason, steps, ...) and every message with
its role, whether it is trained (its ``loss`` flag) and, for assistant turns, how many tokens the
policy generated. Those counts come from the stored ``turn_token_ids``, which belong to the
*last* assistant messages (``flywheel.trajectory``); a turn without stored ids (the
``Ok.`` acknowledgement, expert and imported turns, every turn of an eval artifact) shows
``n/a``. Colour only on a terminal, and never when ``NO_COLOR`` is set.

    flywheel show explore-1a2b3c4d5e6f --failed --limit 3
    flywheel show expert-9f8e7d6c5b4a --task arith-train-00017
    flywheel show pairs-0a1b2c3d4e5f --source expert
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

import pyarrow as pa
import pyarrow.compute as pc

from data_contracts.trajectories import SOURCES
from flywheel.store import Store
from flywheel.trajectory import align_turn_ids

KINDS = ("trajectories", "eval", "groups", "pairs")
DEFAULT_LIMIT = 10
# (label, column) of an episode's header, in order; a kind shows the columns it has.
HEADER = (
    ("env", "env"),
    ("source", "source"),
    ("sample", "sample_idx"),
    ("round", "round"),
    ("policy", "policy"),
    ("stage", "policy_stage"),
    ("difficulty", "difficulty"),
    ("group_front", "group_front"),
    ("pareto_rank", "pareto_rank"),
)
PAIR_HEADER = (("env", "env"), ("kind", "kind"), ("round", "round"), ("policy", "policy"))
OUTCOME = (
    ("reward", "reward"),
    ("success", "success"),
    ("finish", "finish_reason"),
    ("steps", "steps"),
    ("tool_calls", "tool_calls"),
    ("tokens", "tokens"),
)
# Control characters in model output (an escape sequence, a carriage return) would drive the
# terminal: they are printed as \x.. escapes; newlines and tabs stay.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
ROLE_COLORS = {"system": "35", "user": "36", "assistant": "32", "tool": "33"}
BOLD, DIM, RED, GREEN = "1", "2", "31", "32"


def use_color(stream: IO[str]) -> bool:
    """Colour on a terminal unless ``NO_COLOR`` is set to anything (https://no-color.org)."""
    if os.environ.get("NO_COLOR"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


@dataclass(frozen=True)
class _Style:
    color: bool

    def __call__(self, text: str, *codes: str) -> str:
        if not self.color or not codes:
            return text
        return f"\x1b[{';'.join(codes)}m{text}\x1b[0m"


def _printable(text: str) -> str:
    return _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", text)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.2f}"
    return _printable(str(value))


def _check(kind: str, artifact_id: str, failed: bool, source: str | None) -> None:
    if kind not in KINDS:
        raise ValueError(
            f"artifact {artifact_id} is a {kind} artifact; show reads {', '.join(KINDS)}"
        )
    if source is not None and source not in SOURCES:
        raise ValueError(f"--source {source!r}: expected one of {', '.join(SOURCES)}")
    if source is not None and kind not in ("trajectories", "pairs"):
        raise ValueError(f"--source: {kind} rows have no source (trajectories and pairs do)")
    if failed and kind == "pairs":
        raise ValueError("--failed: pairs have no success flag (each side has a reward)")


def _matching(
    table: pa.Table, kind: str, task: str | None, failed: bool, source: str | None
) -> pa.Table:
    keep = pa.array([True] * table.num_rows, pa.bool_())
    if task is not None:
        keep = pc.and_(keep, pc.equal(table["task_id"], task))
    if failed:
        keep = pc.and_(keep, pc.invert(pc.fill_null(table["success"], False)))
    if source is not None:
        if kind == "pairs":
            side = pc.or_(
                pc.equal(table["chosen_source"], source), pc.equal(table["rejected_source"], source)
            )
        else:
            side = pc.equal(table["source"], source)
        keep = pc.and_(keep, side)
    return table.filter(keep)


def _messages(
    messages: Sequence[dict], counts: Sequence[int | None], style: _Style, indent: str
) -> Iterator[str]:
    """One block per message: role, loss flag, generated tokens (assistant turns), content.
    ``counts`` has one entry per assistant message (None: no stored ids)."""
    turn = 0
    for message in messages:
        role = message["role"]
        trained = bool(message.get("loss"))
        tokens = ""
        if role == "assistant":
            count = counts[turn] if turn < len(counts) else None
            tokens = "n/a" if count is None else f"{count} tok"
            turn += 1
        flag = style("trained", BOLD, GREEN) if trained else style(f"{'-':<7}", DIM)
        head = f"{indent}{style(f'{role:<9}', ROLE_COLORS.get(role, BOLD))} {flag} {tokens:>7}  "
        width = len(indent) + 9 + 1 + 7 + 1 + 7 + 2
        lines = _printable(message["content"] or "").split("\n")
        body = [style(line, BOLD) if trained else line for line in lines]
        yield head + body[0]
        for line in body[1:]:
            yield " " * width + line


def _counts(messages: Sequence[dict], turn_ids: Sequence[Sequence[int]] | None) -> list[int | None]:
    aligned = align_turn_ids(messages, turn_ids or [])
    return [len(ids) if ids else None for ids in aligned]


def _fields(row: dict, spec: Sequence[tuple[str, str]], style: _Style) -> str:
    parts = []
    for label, column in spec:
        if column not in row:
            continue
        text = _value(row[column])
        if column == "success":
            text = style(text, GREEN if row[column] else RED)
        parts.append(f"{label}={text}")
    return "  ".join(parts)


def _episode(row: dict, number: str, style: _Style) -> Iterator[str]:
    title = f"== {number}  {_printable(row['task_id'])}"
    yield style(title, BOLD) + "  " + _fields(row, HEADER, style)
    yield "   " + _fields(row, OUTCOME, style)
    messages = row["messages"]
    yield from _messages(messages, _counts(messages, row.get("turn_token_ids")), style, "   ")


def _pair(row: dict, number: str, style: _Style) -> Iterator[str]:
    title = f"== {number}  {_printable(row['task_id'])}"
    yield style(title, BOLD) + "  " + _fields(row, PAIR_HEADER, style)
    prompt = row["prompt"]
    n_prompt = sum(m["role"] == "assistant" for m in prompt)
    for side in ("chosen", "rejected"):
        counts = _counts(prompt + row[side], row[f"{side}_turn_token_ids"])
        if side == "chosen":
            yield "   " + style("prompt", BOLD)
            yield from _messages(prompt, counts[:n_prompt], style, "     ")
        sample = row[f"{side}_sample_idx"]
        where = row[f"{side}_source"] + (f" sample {sample}" if sample >= 0 else "")
        yield "   " + style(f"{side} ({where}, reward {row[f'{side}_reward']:.2f})", BOLD)
        yield from _messages(row[side], counts[n_prompt:], style, "     ")


def render(
    store: Store,
    artifact_id: str,
    *,
    task: str | None = None,
    failed: bool = False,
    source: str | None = None,
    limit: int = DEFAULT_LIMIT,
    color: bool = False,
) -> str:
    """The episodes of ``artifact_id`` that pass the filters, at most ``limit`` (0: all), then
    one line saying how many were shown of how many."""
    ref = store.get(artifact_id)
    _check(ref.kind, artifact_id, failed, source)
    table = store.read(ref)
    matched = _matching(table, ref.kind, task, failed, source)
    shown = matched if limit == 0 else matched.slice(0, limit)
    style = _Style(color)
    draw = _pair if ref.kind == "pairs" else _episode
    lines: list[str] = []
    for i, row in enumerate(shown.to_pylist(), 1):
        lines.extend(draw(row, f"{i}/{matched.num_rows}", style))
        lines.append("")
    filters = [f"--task {task}"] if task is not None else []
    filters += ["--failed"] if failed else []
    filters += [f"--source {source}"] if source is not None else []
    what = "pairs" if ref.kind == "pairs" else "episodes"
    summary = f"{shown.num_rows} of {matched.num_rows} {what} shown"
    if filters:
        summary += f" ({matched.num_rows} of {table.num_rows} match {' '.join(filters)})"
    if not matched.num_rows:
        summary = f"no {what} match {' '.join(filters)} ({table.num_rows} in {artifact_id})"
        summary = summary if filters else f"{artifact_id} has no rows"
    if shown.num_rows < matched.num_rows:
        summary += "; --limit 0 shows all"
    lines.append(style(summary, DIM))
    return "\n".join(lines) + "\n"
