"""flywheel.progress: plain periodic lines off a TTY, a bar redrawn in place on one, and every
line sent to the Prefect run's logs inside a flow (a real flow on the ephemeral server) while
the console shows it once.

    .venv/bin/python -m pytest tests/flywheel/test_progress.py -q
"""

from __future__ import annotations

import asyncio
import io
import re
import time

import pytest

from flywheel import progress
from flywheel.progress import Progress, duration, say


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _auto_mode(monkeypatch):
    monkeypatch.delenv(progress.MODE_ENV, raising=False)
    monkeypatch.setenv(progress.SECONDS_ENV, "10")
    monkeypatch.setenv("COLUMNS", "200")  # the bar is cut to the terminal's width
    yield
    assert progress._active == [], "a reporter was left open"


def test_not_a_tty_prints_plain_periodic_lines_with_rate_and_eta():
    out, clock = io.StringIO(), FakeClock()
    with Progress("explore:", 40, unit="episodes", stream=out, clock=clock) as bar:
        for _ in range(40):
            clock.now += 1.0  # one episode a second, then 4 s of tokens per 10 episodes
            bar.update(1, tokens=100)
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    # one line each time 10 s passed without one: after 10, 20, 30 and 40 episodes
    assert lines == [
        "explore: 10/40 episodes (25%), 1.00 episodes/s, 100 tok/s, ETA 0:30",
        "explore: 20/40 episodes (50%), 1.00 episodes/s, 100 tok/s, ETA 0:20",
        "explore: 30/40 episodes (75%), 1.00 episodes/s, 100 tok/s, ETA 0:10",
        "explore: 40/40 episodes (100%), 1.00 episodes/s, 100 tok/s, took 0:40",
    ]


def test_lines_and_notes_reset_the_heartbeat_and_resumed_work_is_not_in_the_rate():
    out, clock = io.StringIO(), FakeClock()
    with Progress("[train sft]", 30, unit="steps", done=10, stream=out, clock=clock) as bar:
        for step in range(11, 31):
            clock.now += 2.0
            bar.update(1, loss=1.0 / step)
            if step % 8 == 0:
                bar.line(f"[train sft] step {step}/30, {bar.rate()}, {bar.eta()}")
    assert out.getvalue().splitlines() == [
        # 10 s without a line: a heartbeat; the 10 resumed steps do not count toward the rate
        "[train sft] 15/30 steps (50%), 0.50 steps/s, loss 0.0667, ETA 0:30",
        "[train sft] step 16/30, 0.50 steps/s, ETA 0:28",
        "[train sft] 21/30 steps (70%), 0.50 steps/s, loss 0.0476, ETA 0:18",  # 10 s after 16
        "[train sft] step 24/30, 0.50 steps/s, ETA 0:12",
        "[train sft] 29/30 steps (96%), 0.50 steps/s, loss 0.0345, ETA 0:02",
    ]


def test_tty_redraws_one_line_in_place_and_notes_go_above_it():
    out, clock = FakeTTY(), FakeClock()
    with Progress("[train dpo]", 5, unit="steps", stream=out, clock=clock) as bar:
        for step in range(1, 6):
            clock.now += 0.5
            bar.update(1, tokens=64, loss=0.7 - step / 100)
            bar.line(f"[train dpo] step {step}/5")  # the bar shows it: not printed on a TTY
            if step == 3:
                bar.note("[train dpo] validate step 3: val_loss 0.5000")
    text = out.getvalue()
    assert "[train dpo] step " not in text
    frames = text.split("\r")
    draws = [f for f in frames if f.startswith("[train dpo] [")]
    assert len(draws) >= 5  # every step (half a second apart) redraws
    assert all(f.endswith("\x1b[K") or f.endswith("\x1b[K\n") for f in draws)
    assert "[train dpo] [====================] 5/5 steps (100%), 2.00 steps/s" in draws[-1]
    assert "128 tok/s, loss 0.6500, took 0:02" in draws[-1]
    assert draws[1].startswith("[train dpo] [========            ] 2/5 steps (40%)")
    assert "2.00 steps/s, 128 tok/s, loss 0.6800, ETA 0:02" in draws[1]
    # the note clears the bar's line, stays on its own line, and the bar comes back under it
    assert "\x1b[K[train dpo] validate step 3: val_loss 0.5000\n\r[train dpo] [" in text
    assert text.endswith("\n")  # closed: the final bar keeps its line


def test_tty_redraws_at_most_ten_times_a_second():
    out, clock = FakeTTY(), FakeClock()
    with Progress("x", 1000, stream=out, clock=clock) as bar:
        for _ in range(999):
            clock.now += 0.001
            bar.update()
    assert 9 <= out.getvalue().count("\r") <= 12


def test_the_mode_can_be_forced(monkeypatch):
    monkeypatch.setenv(progress.MODE_ENV, "lines")
    out = FakeTTY()
    with Progress("x", 2, stream=out) as bar:
        bar.update(2)
        bar.line("x: done")
    assert out.getvalue() == "x: done\n"
    monkeypatch.setenv(progress.MODE_ENV, "bar")
    out2 = io.StringIO()
    with Progress("x", 2, stream=out2) as bar:
        bar.update(2)
    assert out2.getvalue().startswith("\rx [====")


def test_say_prints_above_the_live_bar_and_close_with_text_replaces_it(capsys):
    out = FakeTTY()
    bar = Progress("expert: arith train:", 2, stream=out)
    bar.update(1)
    say("status line")
    bar.update(1)
    bar.close("expert: arith train: 2 trajectories")
    text = out.getvalue()
    assert "\x1b[Kstatus line\n" in text
    assert text.endswith("\r\x1b[Kexpert: arith train: 2 trajectories\n")
    say("after")  # no live bar: plain stdout
    assert capsys.readouterr().out == "after\n"


def test_rank_other_than_zero_reports_nothing():
    out = io.StringIO()
    bar = Progress("x", 2, stream=out, enabled=False)
    bar.update(2)
    bar.line("line")
    bar.note("note")
    bar.close("closed")
    assert out.getvalue() == "" and progress._active == []


def test_outside_a_flow_nothing_is_sent():
    assert progress.to_prefect("no run here") is False


def _flow_logs(flow_run_id: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async def read() -> list:
        async with get_client() as client:
            return await client.read_logs(
                LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
            )

    return asyncio.run(read())


@pytest.mark.timeout(300)
def test_lines_reach_the_flow_run_logs_and_the_console_once(capfd):
    from prefect import flow, task
    from prefect.context import get_run_context
    from prefect.logging.handlers import APILogWorker

    @task(task_run_name="stage-round-0")
    def stage() -> str:
        with Progress("stage:", 3, unit="episodes") as bar:
            for i in range(3):
                bar.update(1, tokens=5)
                bar.line(f"stage: episode {i + 1}/3")
        say("stage: done")
        return str(get_run_context().task_run.id)  # type: ignore[union-attr]

    @flow(name="progress-test")
    def run() -> tuple[str, str]:
        say("flow: start")
        task_run = stage()
        return str(get_run_context().flow_run.id), task_run  # type: ignore[union-attr]

    capfd.readouterr()
    flow_run_id, task_run_id = run()
    printed = capfd.readouterr()
    sent = ["flow: start", "stage: episode 1/3", "stage: episode 2/3", "stage: episode 3/3"]
    sent.append("stage: done")
    console = printed.out + printed.err
    for line in sent:
        assert console.count(line) == 1, console  # our print only: no Prefect console copy

    APILogWorker.drain_all(timeout=30)
    deadline, logs = time.monotonic() + 30, []
    while time.monotonic() < deadline:
        logs = [log for log in _flow_logs(flow_run_id) if log.name == progress.LOGGER]
        if len(logs) >= len(sent):
            break
        time.sleep(0.5)
    by_message = {log.message: log for log in logs}
    assert sorted(by_message) == sorted(sent) and len(logs) == len(sent)
    assert by_message["flow: start"].task_run_id is None
    for line in sent[1:]:
        assert str(by_message[line].task_run_id) == task_run_id
    assert all(log.level == 20 for log in logs)
    assert not re.search(r"\r|\x1b", "".join(log.message for log in logs))


def test_duration_shows_hours_only_when_there_are_any():
    assert [duration(s) for s in (7, 725, 3861.8, 36000)] == [
        "0:07",
        "12:05",
        "1:04:22",
        "10:00:00",
    ]
