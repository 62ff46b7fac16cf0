"""``flywheel show`` through ``flywheel.cli.main`` on the shared tiny flywheel (``slow``: the
run is shared with the flow and tracking tests): every episode's header and messages, loss flags
and per-turn token counts equal to the artifact's rows, the filters, colour only on a terminal,
one-line errors; and, on a hand-written artifact, model output that cannot drive the terminal."""

from __future__ import annotations

import io
import re
import sys

import pytest

from flywheel.cli import main
from flywheel.config import dump_config, load_config
from flywheel.store import Store

ANSI = re.compile(r"\x1b\[[0-9;]*m")
HEADER = re.compile(r"^== (\d+)/(\d+)  (\S+)  (.*)$")
MESSAGE = re.compile(r"^ +(user|assistant|system|tool) +(trained|-) +(n/a|\d+ tok)?  ")


@pytest.fixture(scope="module")
def shown(tiny_flywheel, tmp_path_factory):
    """(config path, store, {stage or kind: artifact id}) of the tiny flywheel's store."""
    path = tmp_path_factory.mktemp("show") / "tiny.yaml"
    path.write_text(dump_config(load_config(None, tiny_flywheel.overrides)))
    cfg = load_config(path)
    store = Store(cfg.run.store_root(), cfg.run.name)
    ids = {}
    for ref in store.list():
        ids.setdefault(ref.kind if ref.stage == "pareto" else ref.stage, ref.id)
    return path, store, ids


def show(capsys, path, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["show", "--config", str(path), *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def episodes(out: str) -> list[tuple[str, str, list[tuple[str, bool, int | None]]]]:
    """(task id, header fields, [(role, trained, generated tokens or None)]) per episode."""
    found: list[tuple[str, str, list[tuple[str, bool, int | None]]]] = []
    for line in out.splitlines():
        m = HEADER.match(line)
        if m:
            found.append((m[3], m[4], []))
            continue
        if found and line.startswith("   reward="):
            found[-1] = (found[-1][0], found[-1][1] + "  " + line.strip(), found[-1][2])
            continue
        m = MESSAGE.match(line)
        if m and found:
            count = None if m[3] in (None, "n/a") else int(m[3].split()[0])
            found[-1][2].append((m[1], m[2] == "trained", count))
    return found


def expected_turns(messages: list[dict], turn_ids: list[list[int]]):
    """Stored turn ids belong to the last assistant messages (the trajectories contract)."""
    n_assistant = sum(m["role"] == "assistant" for m in messages)
    first_stored = n_assistant - len(turn_ids)
    turns, j = [], 0
    for m in messages:
        count = None
        if m["role"] == "assistant":
            count = len(turn_ids[j - first_stored]) if j >= first_stored else None
            j += 1
        turns.append((m["role"], bool(m["loss"]), count))
    return turns


@pytest.mark.slow  # the shared tiny flywheel run
def test_explore_episodes_show_loss_flags_and_generated_tokens_per_turn(shown, capsys):
    path, store, ids = shown
    rows = store.read(ids["explore"]).to_pylist()
    rc, out, err = show(capsys, path, ids["explore"], "--limit", "0")
    assert (rc, err) == (0, "")
    printed = episodes(out)
    assert len(printed) == len(rows) > 0
    assert f"{len(rows)} of {len(rows)} episodes shown" in out
    for (task, fields, turns), row in zip(printed, rows, strict=True):
        assert task == row["task_id"]
        assert f"source=explore  sample={row['sample_idx']}" in fields
        assert f"reward={row['reward']:.2f}" in fields
        assert f"success={'yes' if row['success'] else 'no'}" in fields
        assert f"finish={row['finish_reason']}  steps={row['steps']}" in fields
        assert turns == expected_turns(row["messages"], row["turn_token_ids"])
        generated = [c for role, _, c in turns if role == "assistant" and c is not None]
        assert len(generated) == len(row["turn_token_ids"]) > 0
        assert sum(generated) == row["tokens"]
    for _, _, turns in printed:  # "Ok." is neither generated nor trained; sampled turns are both
        assert turns[1] == ("assistant", False, None)
        assert all(trained for _, trained, count in turns if count is not None)


@pytest.mark.slow  # the shared tiny flywheel run
def test_expert_and_eval_turns_have_no_stored_ids(shown, capsys):
    path, store, ids = shown
    rows = store.read(ids["expert"]).to_pylist()
    rc, out, _ = show(capsys, path, ids["expert"], "--limit", "3")
    assert rc == 0
    printed = episodes(out)
    assert len(printed) == 3
    assert f"3 of {len(rows)} episodes shown; --limit 0 shows all" in out
    for (_, fields, turns), row in zip(printed, rows, strict=False):
        assert "source=expert" in fields
        assert turns == [(m["role"], bool(m["loss"]), None) for m in row["messages"]]
        assert any(trained for _, trained, _ in turns)  # the oracle's turns are trained
    rc, out, _ = show(capsys, path, ids["evaluate"], "--limit", "0")
    evals = store.read(ids["evaluate"]).to_pylist()
    assert rc == 0 and len(episodes(out)) == len(evals)
    assert all(c is None for _, _, turns in episodes(out) for _, _, c in turns)
    assert "stage=" in episodes(out)[0][1] and "difficulty=" in episodes(out)[0][1]


@pytest.mark.slow  # the shared tiny flywheel run
def test_filters_task_failed_and_source(shown, capsys):
    path, store, ids = shown
    rows = store.read(ids["explore"]).to_pylist()
    task = rows[-1]["task_id"]
    rc, out, _ = show(capsys, path, ids["explore"], "--task", task, "--limit", "0")
    assert rc == 0
    printed = episodes(out)
    assert [p[0] for p in printed] == [r["task_id"] for r in rows if r["task_id"] == task]
    assert len(printed) == 2  # K samples of the task

    failed = [r for r in rows if not r["success"]]
    rc, out, _ = show(capsys, path, ids["explore"], "--failed", "--limit", "0")
    assert rc == 0 and failed
    printed = episodes(out)
    assert len(printed) == len(failed)
    assert all("success=no" in fields for _, fields, _ in printed)
    expert_rows = store.read(ids["expert"]).num_rows
    rc, out, _ = show(capsys, path, ids["expert"], "--failed")  # the oracle always succeeds
    assert rc == 0 and episodes(out) == []
    assert f"no episodes match --failed ({expert_rows} in {ids['expert']})" in out

    rc, out, _ = show(capsys, path, ids["explore"], "--source", "revision")
    assert rc == 0 and episodes(out) == [] and "no episodes match --source revision" in out
    rc, out, _ = show(capsys, path, ids["explore"], "--source", "explore", "--limit", "0")
    assert len(episodes(out)) == len(rows)


@pytest.mark.slow  # the shared tiny flywheel run
def test_pairs_show_prompt_chosen_and_rejected(shown, capsys):
    path, store, ids = shown
    pairs = store.read(ids["pairs"]).to_pylist()
    assert pairs
    rc, out, _ = show(capsys, path, ids["pairs"], "--limit", "1")
    assert rc == 0
    pair = pairs[0]
    text = ANSI.sub("", out)
    assert f"kind={pair['kind']}" in text
    assert (
        f"chosen ({pair['chosen_source']}" in text
        and f"rejected ({pair['rejected_source']}" in text
    )
    turns = episodes(out)[0][2]
    assert len(turns) == len(pair["prompt"]) + len(pair["chosen"]) + len(pair["rejected"])
    rejected = turns[len(pair["prompt"]) + len(pair["chosen"]) :]
    stored = [len(t) for t in pair["rejected_turn_token_ids"]]
    assert [c for role, _, c in rejected if role == "assistant" and c is not None] == stored
    with_expert = [p for p in pairs if "expert" in (p["chosen_source"], p["rejected_source"])]
    rc, out, _ = show(capsys, path, ids["pairs"], "--source", "expert", "--limit", "0")
    assert len(episodes(out)) == len(with_expert)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.slow  # the shared tiny flywheel run
def test_colour_only_on_a_terminal_without_no_color(shown, capsys, monkeypatch):
    path, _, ids = shown
    monkeypatch.delenv("NO_COLOR", raising=False)
    rc, plain, _ = show(capsys, path, ids["explore"], "--limit", "2")
    assert rc == 0 and not ANSI.search(plain)  # captured output is not a terminal
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert main(["show", "--config", str(path), ids["explore"], "--limit", "2"]) == 0
    coloured = terminal.getvalue()
    assert ANSI.search(coloured) and "\x1b[1;32mtrained\x1b[0m" in coloured
    assert ANSI.sub("", coloured) == plain  # the same text, coloured
    monkeypatch.setenv("NO_COLOR", "1")
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert main(["show", "--config", str(path), ids["explore"], "--limit", "2"]) == 0
    assert terminal.getvalue() == plain


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["nope-0123456789ab"], "no artifact nope-0123456789ab"),
        (["{sft}"], "is a checkpoints artifact"),
        (["{explore}", "--source", "nope"], "--source 'nope': expected one of expert, explore"),
        (["{evaluate}", "--source", "explore"], "eval rows have no source"),
        (["{pairs}", "--failed"], "pairs have no success flag"),
        (["{explore}", "--limit", "-1"], "expected an integer >= 0"),
        (["../x"], "not a plain name"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(shown, capsys, argv, needle):
    path, _, ids = shown
    rc, out, err = show(capsys, path, *(a.format(**ids) for a in argv))
    assert rc == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("flywheel: error: "), err
    assert needle in err


def test_control_characters_in_model_output_never_reach_the_terminal(tmp_path):
    """A policy's text is data: an escape sequence or a carriage return in it is printed as
    ``\\x..``, multi-line content stays indented under its message."""
    from flywheel.show import render

    store = Store(str(tmp_path / "store"), "hostile")
    w = store.writer("trajectories", stage="explore", round=1, config={}, inputs=[])
    text = "\x1b[2J\x1b]0;owned\x07first line\r\nsecond line"
    row = {
        "task_id": "t-\x1b[31m0",
        "env": "arith",
        "split": "train",
        "round": 1,
        "policy": "sft-x",
        "source": "explore",
        "sample_idx": 0,
        "messages": [
            {"role": "user", "content": "Solve.", "loss": False},
            {"role": "assistant", "content": "Ok.", "loss": False},
            {"role": "user", "content": "1 + 1?", "loss": False},
            {"role": "assistant", "content": text, "loss": True},
        ],
        "reward": 0.0,
        "success": False,
        "steps": 1,
        "tool_calls": 0,
        "tool_errors": 0,
        "tool_ok": 0,
        "invalid_actions": 1,
        "tokens": 5,
        "finish_reason": "max_steps",
        "seed": 1,
        "turn_token_ids": [[1, 2, 3, 4, 5]],
        "turn_logprobs": [[-0.1] * 5],
    }
    w.write_shard(0, [row])
    ref = w.commit()
    for color in (False, True):
        out = render(store, ref.id, color=color)
        plain = ANSI.sub("", out)
        assert "\x1b[2J" not in out and "\x07" not in out and "\r" not in out
        assert "\\x1b[2J\\x1b]0;owned\\x07first line\\x0d" in plain
        assert "t-\\x1b[31m0" in plain
        lines = plain.splitlines()
        first = next(i for i, line in enumerate(lines) if "owned" in line)
        assert re.match(r" +assistant +trained +5 tok  ", lines[first])
        assert lines[first + 1].strip() == "second line"
        assert lines[first + 1].index("second") == lines[first].index("\\x1b[2J")
    assert not ANSI.search(render(store, ref.id))
