"""Progress of long work (episodes of expert, explore and evaluate; training steps) and the
stages' one-line status messages, on a terminal, in logs, and in the Prefect UI.

    with Progress("explore:", total=40, unit="episodes") as bar:
        for ...:
            bar.update(1, tokens=n)            # a bar on a TTY; a line every 30 s otherwise
        bar.note("explore: shard 1/5 ...")     # a line that stays, in every mode
    say("sft: round 0, 24 trajectories")     # one status line

On a TTY (``sys.stdout.isatty()``) the bar is one line redrawn in place: done/total, rate,
tokens/s, the training loss where there is one, and the ETA. Elsewhere (CI, a Prefect worker,
a pipe) nothing is redrawn: the work prints plain lines, at its own events (a shard written,
every ``run.log_every`` training steps) and, between them, a status line whenever
``FLYWHEEL_PROGRESS_SECONDS`` (default 30) pass without one. ``FLYWHEEL_PROGRESS=lines``
prints lines on a TTY too, ``bar`` draws the bar even when stdout is not a TTY.

Inside a Prefect flow or task run every line (not the bar's redraws) is also sent to the run's
logs, so the Prefect UI shows them under the flow run and its stage (task) runs. They go
through the logger ``flywheel.progress``, which carries only Prefect's ``APILogHandler`` and does
not propagate: the terminal shows each line once (our print), whatever Prefect's own console
logging is set to (``flywheel`` keeps it at CRITICAL). ``PREFECT_LOGGING_TO_API_ENABLED=false``
turns the sending off. Prefect is never imported here: outside a flow (a stage run from a test
or a script) it is not loaded, and nothing is sent.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

MODE_ENV = "FLYWHEEL_PROGRESS"  # auto (default) | bar | lines
SECONDS_ENV = "FLYWHEEL_PROGRESS_SECONDS"
DEFAULT_SECONDS = 30.0
REDRAW_S = 0.1  # the bar is redrawn at most this often
LOGGER = "flywheel.progress"

_active: list[Progress] = []  # live reporters, innermost last: status lines go above its bar


def say(text: str) -> None:
    """One status line: on stdout once (above a live bar) and in the Prefect run's logs."""
    if _active:
        _active[-1].note(text)
    else:
        _write(None, text + "\n")
        to_prefect(text)


def to_prefect(text: str, level: int = logging.INFO) -> bool:
    """Send ``text`` to the logs of the current Prefect flow or task run; False outside one."""
    if "prefect" not in sys.modules:  # no flow runs in a process that never imported Prefect
        return False
    from prefect.context import FlowRunContext, TaskRunContext

    if TaskRunContext.get() is None and FlowRunContext.get() is None:
        return False
    from prefect.logging import get_run_logger

    run_logger = get_run_logger()  # the run's ids and names, as Prefect's own run logs carry
    extra = dict(getattr(run_logger, "extra", None) or {})
    _api_logger().log(level, text, extra=extra)
    return True


def _api_logger() -> logging.Logger:
    logger = logging.getLogger(LOGGER)
    if not logger.handlers:
        from prefect.logging.handlers import APILogHandler

        logger.addHandler(APILogHandler())
        logger.setLevel(logging.INFO)
        logger.propagate = False  # the console copy is our print
    return logger


def _write(stream: TextIO | None, text: str) -> None:
    out = stream if stream is not None else sys.stdout
    out.write(text)
    out.flush()


def duration(seconds: float) -> str:
    """``0:07``, ``12:05``, ``1:04:21``: minutes and seconds, hours when there are any."""
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def _rate(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.0f}"


class Progress:
    """Progress of ``total`` units of work (``unit``: episodes, steps, pairs).

    ``done`` units are already finished (a resumed run): they count toward done/total, not
    toward the rate. ``stream`` defaults to ``sys.stdout`` at each write (so redirected output
    is followed); ``enabled=False`` (ranks other than 0) reports nothing."""

    def __init__(
        self,
        label: str,
        total: int,
        *,
        unit: str = "episodes",
        done: int = 0,
        stream: TextIO | None = None,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.label, self.total, self.unit = label, max(total, 0), unit
        self.done = self.start = done
        self.tokens = 0
        self.loss: float | None = None
        self.stream, self.enabled, self.clock = stream, enabled, clock
        mode = os.environ.get(MODE_ENV, "auto").strip().lower()
        tty = bool(getattr(stream if stream is not None else sys.stdout, "isatty", _no)())
        self.bar = enabled and (mode == "bar" or (mode != "lines" and tty))
        self.seconds = float(os.environ.get(SECONDS_ENV) or DEFAULT_SECONDS)
        self.t0 = self.last_line = clock()
        self.last_draw = -float("inf")
        self.drawn = False
        self.closed = False
        if enabled:
            _active.append(self)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def update(self, n: int = 1, *, tokens: int = 0, loss: float | None = None) -> None:
        """``n`` more units done (``tokens`` generated or trained on, the last ``loss``)."""
        self.done += n
        self.tokens += tokens
        if loss is not None:
            self.loss = loss
        if not self.enabled:
            return
        now = self.clock()
        if now - self.last_line >= self.seconds:
            self.line(f"{self.label} {self.status()}")
        if self.bar and (now - self.last_draw >= REDRAW_S or self.done >= self.total):
            self._draw(now)

    def line(self, text: str) -> None:
        """A periodic line: printed when there is no bar (the bar shows the same), always
        sent to the Prefect run's logs."""
        if not self.enabled:
            return
        self.last_line = self.clock()
        if not self.bar:
            _write(self.stream, text + "\n")
        to_prefect(text)

    def note(self, text: str) -> None:
        """A line that stays on screen in every mode (printed above the bar)."""
        if not self.enabled:
            return
        self.last_line = self.clock()
        if self.bar and self.drawn:
            _write(self.stream, "\r\x1b[K" + text + "\n")
            self._draw(self.last_line)
        else:
            _write(self.stream, text + "\n")
        to_prefect(text)

    def status(self) -> str:
        """``12/40 episodes (30%), 2.50 episodes/s, 410 tok/s, loss 0.5321, ETA 0:11``."""
        done = f"{self.done}/{self.total} {self.unit}"
        if self.total:
            done += f" ({100 * self.done // self.total}%)"
        elapsed = max(self.clock() - self.t0, 1e-9)
        parts = [done, self.rate()]
        if self.tokens:
            parts.append(f"{self.tokens / elapsed:.0f} tok/s")
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        return ", ".join([*parts, self.eta()])

    def rate(self) -> str:
        """Units per second since the start (resumed units left out): ``2.50 episodes/s``."""
        elapsed = max(self.clock() - self.t0, 1e-9)
        return f"{_rate((self.done - self.start) / elapsed)} {self.unit}/s"

    def eta(self) -> str:
        """``ETA 0:11`` while working (``ETA ?`` before the first unit), ``took 1:05`` when done."""
        elapsed = max(self.clock() - self.t0, 1e-9)
        if self.done >= self.total:
            return f"took {duration(elapsed)}"
        rate = (self.done - self.start) / elapsed
        return f"ETA {duration((self.total - self.done) / rate)}" if rate > 0 else "ETA ?"

    def _draw(self, now: float) -> None:
        width = shutil.get_terminal_size((100, 20)).columns - 1
        status = self.status()
        # The bar gives way first, so the numbers (the ETA last) fit a narrow terminal.
        size = min(20, width - len(self.label) - len(status) - 4)
        filled = size * self.done // self.total if self.total else size
        bar = f" [{'=' * filled}{' ' * (size - filled)}]" if size >= 5 else ""
        text = f"{self.label}{bar} {status}"
        _write(self.stream, "\r" + text[:width] + "\x1b[K")
        self.last_draw, self.drawn = now, True

    def close(self, text: str | None = None) -> None:
        """End the report. On a TTY the bar stays as it last was, on its own line; ``text``,
        when given, takes its place (a line in every mode, like ``note``)."""
        if self.closed:
            return
        self.closed = True
        if self.bar and self.drawn:
            if text is None:
                self._draw(self.clock())
                _write(self.stream, "\n")
            else:
                _write(self.stream, "\r\x1b[K")
            self.drawn = False
        if text is not None:
            self.note(text)
        if self in _active:
            _active.remove(self)


def _no() -> bool:
    return False
