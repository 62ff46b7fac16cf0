"""A policy server that a stage starts, uses and always stops: ``flywheel serve-policy`` or vLLM.

The server runs in its own process group, its output goes to a log file, and the stage waits
for its health route before sending work. ``stop()`` (also on an exception) sends SIGTERM to the
whole group and SIGKILL to what is left after ``grace_s``. A stage that is killed outright
(SIGKILL: no ``finally`` runs) still leaves no server behind: the child asks the kernel for
SIGTERM when its parent dies (``PR_SET_PDEATHSIG``, Linux), and a server that hears SIGTERM
stops the processes it started itself.

    with ManagedServer(argv, env=env, health_url=f"{url}/health", log_path=log) as server:
        ...  # requests to url
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx

_PR_SET_PDEATHSIG = 1
# Loaded here, in the parent: a child forked from a process with threads (flywheel run waits for
# Prefect's server in one) must not dlopen before exec, since another thread may hold the
# loader's lock at the fork.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy; the message's first line says which."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def die_with_parent(parent: int) -> None:
    """Runs in the child before exec (``preexec_fn``): SIGTERM when the parent goes, even by
    SIGKILL."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class ManagedServer:
    def __init__(
        self,
        argv: list[str],
        *,
        name: str,
        health_url: str,
        log_path: Path,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 120.0,
        grace_s: float = 15.0,
    ) -> None:
        self.argv, self.name, self.health_url = argv, name, health_url
        self.log_path, self.env = log_path, env
        self.startup_timeout_s, self.grace_s = startup_timeout_s, grace_s
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        parent = os.getpid()
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # its own group: stop() reaches its children too
                preexec_fn=lambda: die_with_parent(parent),
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerStartError(
                    f"{self.name} exited with status {code} before it was healthy "
                    f"(log: {self.log_path})\n{log_tail(self.log_path)}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.health_url, timeout=2.0).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"{self.name} was not healthy at {self.health_url} within "
                    f"{self.startup_timeout_s:.0f} s (log: {self.log_path})\n"
                    f"{log_tail(self.log_path)}"
                )
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``grace_s``; idempotent."""
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=self.grace_s)
        # Whatever the server left in its group (workers that ignored SIGTERM) goes too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)

    def __enter__(self) -> ManagedServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
