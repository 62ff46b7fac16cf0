"""``run_python``: the trainer's side of a call, in fork mode (the default) or spawn mode."""

from __future__ import annotations

import atexit
import contextlib
import os
import selectors
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import IO, Literal

from flywheel.envs.sandbox.client import HELPER_ENV, ForkServer, Raw, helper_argv

Status = Literal["ok", "error", "timeout", "killed"]
Mode = Literal["fork", "spawn"]

# Each child is one CPU-bound process; more than two per core only adds context switching and
# memory pressure (each may use up to ``memory_mb``, plus ``disk_mb`` of tmpfs).
MAX_CONCURRENT = max(4, 2 * (os.cpu_count() or 1))
_slots = threading.BoundedSemaphore(MAX_CONCURRENT)

_ERROR_LINE_CHARS = 300
_STDERR_TAIL_BYTES = 4096


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one ``run_python`` call.

    ``status``: ``ok`` (ran to the end), ``error`` (an exception or a non-zero exit),
    ``timeout`` (wall clock ran out), ``killed`` (a resource limit or a signal ended it).
    ``output``: captured stdout, at most ``max_output_chars`` characters (``truncated`` says
    whether more was printed). ``error``: one line, empty when ``status`` is ``ok``.
    """

    status: Status
    output: str
    error: str = ""
    truncated: bool = False


def run_python(
    code: str,
    *,
    timeout_s: float = 5.0,
    cpu_s: int = 2,
    memory_mb: int = 512,
    file_size_mb: int = 1,
    disk_mb: int = 16,
    max_output_chars: int = 2000,
    mode: Mode = "fork",
) -> SandboxResult:
    """Run ``code`` in a sandboxed child process and return what happened (never raises).

    ``timeout_s`` is wall-clock time from the start of the call (in ``spawn`` mode interpreter
    startup included); ``cpu_s`` its CPU seconds; ``memory_mb`` its address space;
    ``file_size_mb`` the largest file it may write; ``disk_mb`` all its files together (they
    live in memory and vanish with the call); ``max_output_chars`` how much stdout is kept.
    ``mode``: ``fork`` (a child forked by this process's fork server; falls back to ``spawn``
    when the server cannot run it) or ``spawn`` (a fresh interpreter per call).
    """
    if mode not in ("fork", "spawn"):
        raise ValueError(f"unknown sandbox mode {mode!r}; expected 'fork' or 'spawn'")
    limits = (max(1, int(cpu_s)), int(memory_mb), int(file_size_mb), int(max_output_chars))
    disk = max(1, int(disk_mb))
    source = code.encode("utf-8", "replace")
    timeout_s = float(timeout_s)
    with _slots:
        tmp = tempfile.mkdtemp(prefix="flywheel-sandbox-")
        try:
            raw = None
            if mode == "fork":
                request = (source.decode("utf-8"), tmp, *limits, min(timeout_s, 1e9), disk)
                raw = _fork_server.run(request, timeout_s)
            if raw is None:  # no server, or it died or hung: its call died with it
                raw = _spawn(source, tmp, (*limits, disk), timeout_s)
            return _result(*raw, timeout_s, max_output_chars)
        except Exception as e:  # a failure of ours (spawn, pipes), not of the user code
            return SandboxResult(
                "error", "", _one_line(f"sandbox failure: {type(e).__name__}: {e}")
            )
        finally:
            _remove_tree(tmp)


def _result(
    timed_out: bool, rc: int, stdout: bytes, stderr: bytes, timeout_s: float, max_chars: int
) -> SandboxResult:
    text = stdout.decode("utf-8", "replace")
    truncated = len(text) > max_chars
    text = text[:max_chars]
    if timed_out:
        return SandboxResult("timeout", text, f"timeout after {timeout_s} s", truncated)
    if rc == 0:
        return SandboxResult("ok", text, "", truncated)
    if rc < 0:
        return SandboxResult("killed", text, _signal_message(-rc), truncated)
    lines = stderr.decode("utf-8", "replace").strip().splitlines()
    line = lines[-1] if lines else f"exit code {rc}"
    if line.startswith("MemoryError"):
        line = "memory limit exceeded"
    return SandboxResult("error", text, _one_line(line), truncated)


_fork_server = ForkServer()
atexit.register(lambda: _fork_server.stop())


def _after_fork_in_child() -> None:
    global _slots
    _slots = threading.BoundedSemaphore(MAX_CONCURRENT)  # slots held by threads not copied
    _fork_server.forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


# -- spawn mode ---------------------------------------------------------------------------------


def _spawn(source: bytes, tmp: str, limits: tuple[int, ...], timeout_s: float) -> Raw:
    deadline = time.monotonic() + timeout_s
    proc = subprocess.Popen(
        helper_argv("spawn", tmp, *map(str, limits)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd="/",
        env=HELPER_ENV,
        start_new_session=True,  # its own process group, so a timeout kills all it started
        bufsize=0,
    )
    feeder: threading.Thread | None = None
    try:
        # A source larger than the pipe buffer must not block us past the deadline.
        feeder = threading.Thread(target=_feed, args=(proc.stdin, source), daemon=True)
        feeder.start()
        stdout, stderr, timed_out = _collect(proc, deadline, 4 * limits[3] + 4)
        if not timed_out:
            timed_out = not _wait_unreaped(proc.pid, deadline)
    finally:
        # Kill the group while the unreaped leader still holds the group id, so the id
        # cannot have been reused by an unrelated process.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if feeder is not None and feeder.ident is not None:
            feeder.join(timeout=1.0)  # with the child dead, its write fails at once
        pipes = [proc.stdout, proc.stderr]
        if feeder is None or not feeder.is_alive():  # else the feeder still owns stdin
            pipes.append(proc.stdin)
        for pipe in pipes:
            if pipe is not None:
                pipe.close()
    return timed_out, proc.returncode, stdout, stderr


def _wait_unreaped(pid: int, deadline: float) -> bool:
    """Wait until ``pid`` exits, without reaping it; False if the deadline passes first."""
    delay = 0.0005
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.02)


def _feed(pipe: IO[bytes], data: bytes) -> None:
    with contextlib.suppress(OSError):  # the child died before reading; its exit status says why
        pipe.write(data)
    with contextlib.suppress(OSError):
        pipe.close()


def _collect(
    proc: subprocess.Popen[bytes], deadline: float, max_bytes: int
) -> tuple[bytes, bytes, bool]:
    """Read stdout (first ``max_bytes``) and stderr (last few KB) until EOF or the deadline."""
    out, err = bytearray(), bytearray()
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, out)  # type: ignore[arg-type]
        sel.register(proc.stderr, selectors.EVENT_READ, err)  # type: ignore[arg-type]
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bytes(out), bytes(err), True
            for key, _ in sel.select(remaining):
                chunk = os.read(key.fd, 65536)  # type: ignore[arg-type]
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.data is out:
                    # keep reading past the cap so the child never blocks on a full pipe
                    out += chunk[: max(0, max_bytes - len(out))]
                else:
                    err += chunk
                    del err[:-_STDERR_TAIL_BYTES]
    return bytes(out), bytes(err), False


def _signal_message(signum: int) -> str:
    if signum == signal.SIGXCPU:
        return "cpu time limit exceeded"
    if signum == signal.SIGXFSZ:
        return "file size limit exceeded"
    if signum == signal.SIGKILL:
        return "killed (cpu time or memory limit)"
    if signum == signal.SIGSYS:
        return "killed by the seccomp filter"
    try:
        return f"killed by {signal.Signals(signum).name}"
    except ValueError:
        return f"killed by signal {signum}"


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _ERROR_LINE_CHARS else line[: _ERROR_LINE_CHARS - 3] + "..."


def _remove_tree(path: str) -> None:
    # In fork and spawn mode the code's files live on a tmpfs that vanished with the call;
    # this removes the empty mount point (and anything a fallback left).
    def retry(func, p, _exc):  # type: ignore[no-untyped-def]
        try:
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            os.chmod(p, stat.S_IRWXU)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=retry)
