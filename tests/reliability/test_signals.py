"""SIGTERM and SIGINT stop ``flywheel run`` cleanly: the command exits with 128 + the signal's
number and one line on stderr, no process it started outlives it (Prefect's in-process server,
uvicorn; the sandbox's fork server; anything they started), and the store holds no broken
artifact. Checked from outside with /proc: every descendant is recorded while the run goes,
and after the command exits none of them may be left.

    .venv/bin/python -m pytest tests/reliability/test_signals.py

The helpers here (``ProcessWatch``, ``open_fds``, ``rss_kb``) are shared by the other
reliability tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flywheel.config import load_config
from flywheel.store import Store
from tests.conftest import write_tiny_yaml

ROOT = Path(__file__).resolve().parents[2]
FLYWHEEL = str(Path(sys.executable).parent / "flywheel")


# -- /proc ----------------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time in clock ticks, state) of ``pid``, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # the command name may hold spaces and ')'
    return int(fields[1]), int(fields[19]), fields[0]


def cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:200]


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live descendant of ``root``."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for pid in all_pids():
        st = _stat(pid)
        if st is not None:
            children.setdefault(st[0], []).append(pid)
            starts[pid] = st[1]
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child in starts and child not in found:
                found[child] = starts[child]
                todo.append(child)
    return found


def alive(pid: int, start: int) -> bool:
    """Whether the process ``pid`` that started at ``start`` still runs (a zombie does not)."""
    st = _stat(pid)
    return st is not None and st[1] == start and st[2] != "Z"


class ProcessWatch:
    """Records every descendant of a process while it runs (orphans are re-parented to pid 1,
    so they must be seen while their parent lives) and reports those left after it exits."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.seen: dict[int, tuple[int, str]] = {}  # pid -> (start time, command line)

    def poll(self) -> None:
        # The command line is read again while the process lives: one first seen between fork
        # and exec shows an empty (or its parent's) command line, which exec then replaces.
        for pid, start in descendants(self.proc.pid).items():
            line = cmdline(pid)
            if pid not in self.seen or line not in ("", "?"):
                self.seen[pid] = (start, line)

    def wait(self, timeout: float, until=None) -> bool:
        """Poll every 50 ms until the process exits or ``until()`` is true; True if it did."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            if self.proc.poll() is not None or (until is not None and until()):
                return True
            time.sleep(0.05)
        return False

    def survivors(self, grace: float = 10.0) -> dict[int, str]:
        """Recorded descendants still running ``grace`` seconds after the process exited."""
        deadline = time.monotonic() + grace
        while True:
            left = {p: c for p, (s, c) in self.seen.items() if alive(p, s)}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def kill_all(self) -> None:
        """Clean-up after a failed test: nothing this test started may stay behind."""
        for pid, (start, _) in self.seen.items():
            if alive(pid, start):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def open_fds(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kb(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def threads(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


# -- the test -------------------------------------------------------------------------------------


def kinds(seen: dict[int, tuple[int, str]]) -> set[str]:
    """What sort of processes a run started, by command line."""
    out = set()
    for _, line in seen.values():
        if "uvicorn" in line:
            out.add("prefect-server")
        elif "flywheel.envs.sandbox" in line:
            out.add("sandbox")
        else:
            out.add("other")
    return out


def start_run(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path, ProcessWatch, Path]:
    """`flywheel run` on the tiny config (with ``extra`` overrides) in a process group of its
    own, as a command a terminal runs in the foreground; its output goes to a log file."""
    config = write_tiny_yaml(tmp_path, *extra)
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [FLYWHEEL, "run", "--config", str(config)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    return proc, log, ProcessWatch(proc), config


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "marker", "extra", "group"),
    [
        # SIGTERM in SFT training, to the flywheel process alone (as `kill PID`, a container
        # runtime or a scheduler sends it): 400 steps (tens of seconds), after the untrained
        # policy's evaluation has run the sandbox.
        (
            signal.SIGTERM,
            "[train sft] step",
            ("sft.epochs=200", "sft.max_steps=400", "sft.checkpoint_every=50"),
            False,
        ),
        # SIGINT in an evaluation, to the whole process group (as a terminal's Ctrl-C sends it):
        # the SFT policy's, over 2000 test tasks in 250 shards, sent once its first shard is
        # done. Prefect's server must not hear it (it runs in a session of its own), or Prefect
        # would spend minutes recording the crash with a server that is gone. Both cases leave
        # seconds of work after the marker, so a slow machine cannot finish the run before the
        # signal arrives.
        (
            signal.SIGINT,
            "evaluate: shard 1/250",
            ("evaluate.untrained=false", "envs.arith.n_test=2000"),
            True,
        ),
    ],
    ids=["SIGTERM", "SIGINT-group"],
)
def test_signal_stops_the_run_and_everything_it_started(tmp_path, signum, marker, extra, group):
    """The signal goes to the flywheel process alone or to its process group, in the middle of a
    stage, once Prefect's server and the sandbox run."""
    proc, log, watch, config = start_run(tmp_path, *extra)
    try:
        started = watch.wait(240, until=lambda: marker in log.read_text())
        assert started and proc.poll() is None, f"the run ended early:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)
        watch.poll()
        assert {"prefect-server", "sandbox"} <= kinds(watch.seen), watch.seen
        # Prefect's in-process server listens on loopback only (tests/reliability/test_secrets.py)
        from tests.reliability.test_secrets import listening_sockets, loopback_only

        # Only the servers still running: one seen earlier may have exited since (a process that
        # is gone listens on nothing, and /proc no longer has it).
        checked = 0
        for pid, (start, line) in watch.seen.items():
            if "uvicorn" in line and alive(pid, start):
                try:
                    sockets = listening_sockets(pid)
                except FileNotFoundError:  # exited between the two reads
                    continue
                assert loopback_only(sockets), (line, sockets)
                checked += 1
        assert checked, f"no Prefect server process was running: {watch.seen}"
        sent = time.monotonic()
        if group:
            os.killpg(proc.pid, signum)
        else:
            os.kill(proc.pid, signum)
        assert watch.wait(60), "the run did not stop within 60 s of the signal"
        took = time.monotonic() - sent
        left = watch.survivors()
        assert not left, f"left running after {signum.name}: {left}"
    finally:
        watch.kill_all()
    printed = log.read_text()
    assert proc.returncode == 128 + signum, printed[-3000:]
    assert "flywheel: interrupted" in printed
    assert "Traceback" not in printed, printed[-3000:]
    cfg = load_config(str(config))
    refs, problems = Store(cfg.run.store_root(), cfg.run.name).scan()
    assert not problems and refs  # what was committed is whole; the rest is in .tmp folders
    print(
        f"\n{signum.name}: stopped in {took:.1f}s; {len(watch.seen)} processes started "
        f"({', '.join(sorted(kinds(watch.seen)))}), 0 left"
    )


def test_a_signal_while_prefect_starts_beside_the_imports_stops_the_run(tmp_path):
    """`flywheel run` starts Prefect's server and imports the stages in a thread beside it
    (flywheel/cli.py, ``_start_prefect_server``): SIGTERM in that window, before the flow
    prints its config, still ends in one line, exit 128 + 15 and nothing left running."""
    proc, log, watch, _ = start_run(tmp_path)
    try:
        started = watch.wait(120, until=lambda: "prefect-server" in kinds(watch.seen))
        assert started and proc.poll() is None, f"the run ended early:\n{log.read_text()[-3000:]}"
        assert "config:" not in log.read_text(), "the flow had started: not the window tested"
        os.kill(proc.pid, signal.SIGTERM)
        assert watch.wait(60), "the run did not stop within 60 s of the signal"
        left = watch.survivors()
        assert not left, f"left running after SIGTERM: {left}"
    finally:
        watch.kill_all()
    printed = log.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, printed[-3000:]
    assert "flywheel: interrupted" in printed
    assert "Traceback" not in printed and "Fatal Python error" not in printed, printed[-3000:]


@pytest.mark.slow
def test_a_killed_run_leaves_no_prefect_server(tmp_path):
    """SIGKILL runs no clean-up: Prefect's server, in a session of its own (out of reach of a
    signal to our group), must still go with the run (the kernel's parent-death signal)."""
    proc, log, watch, _ = start_run(tmp_path, "sft.epochs=200", "sft.max_steps=400")
    try:
        started = watch.wait(240, until=lambda: "[round 0] tasks" in log.read_text())
        assert started and proc.poll() is None, f"the run ended early:\n{log.read_text()[-3000:]}"
        watch.poll()
        # The live ones: a server that lost a race for its port (another run starting at the
        # same moment, as under pytest -n 2) has exited and Prefect started one on another.
        servers = [p for p, (t, line) in watch.seen.items() if "uvicorn" in line and alive(p, t)]
        assert servers, watch.seen
        # Not in the run's process group: a terminal's Ctrl-C goes to the run alone.
        assert all(os.getpgid(p) != os.getpgid(proc.pid) for p in servers)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        left = watch.survivors(grace=20)
        assert not left, f"left running after SIGKILL: {left}"
    finally:
        watch.kill_all()
