"""Our side of the fork server: start it, send it calls, match its answers, restart it.

The server (``server.py``) runs in a helper interpreter, ``python -I -S -B`` with a minimal
environment, that loads only this package's kernel-facing modules (``helper_argv``): not the
trainer's imports, threads or secrets. It talks to us over a socketpair and exits, killing its
calls, when our end closes, so also when we are killed. It is restarted on the next call if it
dies. Calls may come from many threads: whole frames are sent under a lock and answers are
matched to calls by id. A process forked from ours (multiprocessing) starts its own server.
"""

from __future__ import annotations

import contextlib
import itertools
import marshal
import math
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import flywheel

_SERVER_START_S = 10.0  # the helper's interpreter startup, on a loaded machine
SERVER_GRACE_S = 10.0  # past a call's timeout, a helper that has not answered is hung
_SERVER_RETRY_S = 30.0  # after a failed start, use spawn mode this long before trying again
HELPER_ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}

# Registers this package's folder without running the package __init__ files (which import
# the trainer's side), then hands over to server.main.
_BOOT = """import sys, types
root = sys.argv[1]
for name in ("flywheel", "flywheel.envs", "flywheel.envs.sandbox"):
    module = types.ModuleType(name)
    module.__path__ = [root + "/" + name.replace(".", "/")]
    sys.modules[name] = module
from flywheel.envs.sandbox.server import main
main(sys.argv[2:])
"""

Raw = tuple[bool, int, bytes, bytes]  # timed out, return code (-signal), stdout head, stderr tail


def helper_argv(*args: str) -> list[str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(flywheel.__file__)))
    return [sys.executable, "-I", "-S", "-B", "-c", _BOOT, root, *args]


class _Call:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.answer: tuple[Any, ...] | None = None  # None: the server died before answering


class Server:
    """One running fork server: its process, our end of its socket, the calls it owes."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.proc, self.sock, self.pid = proc, sock, proc.pid
        self.alive = True
        self._lock = threading.Lock()  # pending calls; held briefly, never while sending
        self._send_lock = threading.Lock()  # whole frames, one at a time
        self._pending: dict[int, _Call] = {}
        self._ids = itertools.count()
        threading.Thread(target=self._read, name="sandbox-fork-server", daemon=True).start()

    def call(self, request: tuple[Any, ...], wait_s: float | None) -> Raw | None:
        call = _Call()
        with self._lock:
            if not self.alive:
                return None
            rid = next(self._ids)
            self._pending[rid] = call
        try:
            with self._send_lock:
                send_frame(self.sock, (rid, *request))
        except OSError:
            self.kill()
        if not call.done.wait(wait_s):
            self.kill()  # hung: its calls die with it (PR_SET_PDEATHSIG)
            call.done.wait(SERVER_GRACE_S)
        answer = call.answer
        if answer is None or not answer[1]:
            return None
        timed_out, rc, out, err = answer[2]
        return bool(timed_out), int(rc), bytes(out), bytes(err)

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes our reader and any sender
        with contextlib.suppress(OSError):
            self.proc.kill()

    def stop(self, wait_s: float = 2.0) -> None:
        """Ask the server to exit (it kills its calls), and kill it if it does not."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _read(self) -> None:
        try:
            while True:
                answer = recv_frame(self.sock)
                with self._lock:
                    call = self._pending.pop(answer[0], None)
                if call is not None:
                    call.answer = answer
                    call.done.set()
        except (OSError, EOFError, ValueError, TypeError, IndexError):
            pass  # closed, killed, or an answer we cannot read: this server is done
        with self._lock:
            self.alive = False
            pending, self._pending = self._pending, {}
        for call in pending.values():
            call.done.set()
        self.kill()
        self.proc.wait()
        with self._send_lock:
            self.sock.close()


class ForkServer:
    """This process's fork server: started on first use, restarted after it dies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._server: Server | None = None
        self._retry_at = 0.0
        self.start_error = ""  # why the last start failed, for logs and tests

    def run(self, request: tuple[Any, ...], timeout_s: float) -> Raw | None:
        """Run one call: ``request`` is (code, dir, cpu, mem, fsize, chars, timeout, disk)."""
        server = self._get()
        if server is None:
            return None
        wait_s = timeout_s + SERVER_GRACE_S if math.isfinite(timeout_s) else None
        return server.call(request, wait_s)

    def pid(self) -> int | None:
        """The running server's process id, starting it if needed (None if it cannot start)."""
        server = self._get()
        return None if server is None else server.pid

    def _get(self) -> Server | None:
        with self._lock:
            if self._server is not None and self._server.alive:
                return self._server
            if time.monotonic() < self._retry_at:
                return None
            try:
                self._server = start_server()
            except Exception as e:
                self._server, self._retry_at = None, time.monotonic() + _SERVER_RETRY_S
                self.start_error = f"{type(e).__name__}: {e}"
            return self._server

    def stop(self) -> None:
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.stop()

    def forget_after_fork(self) -> None:
        # In a child forked from us: the server, its reader thread and the locks are the
        # parent's. Close our copy of its socket (so it still sees EOF when the parent exits).
        server, self._server = self._server, None
        self._lock, self._retry_at = threading.Lock(), 0.0
        if server is not None:
            with contextlib.suppress(OSError):
                server.sock.close()


def start_server() -> Server:
    ours, theirs = socket.socketpair()
    try:
        proc = subprocess.Popen(
            helper_argv("serve", str(theirs.fileno())),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(theirs.fileno(),),
            cwd="/",
            env=HELPER_ENV,
            start_new_session=True,  # Ctrl-C in our terminal is ours to handle, not its
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    try:
        ours.settimeout(_SERVER_START_S)
        hello = recv_frame(ours)
        if hello != ("ready", proc.pid):
            raise RuntimeError(hello[1] if hello[0] == "failed" else f"greeting {hello!r}")
        ours.settimeout(None)
    except BaseException:
        ours.close()
        proc.kill()
        proc.wait()
        raise
    return Server(proc, ours)


def send_frame(sock: socket.socket, msg: tuple[Any, ...]) -> None:
    data = marshal.dumps(msg)
    sock.sendall(len(data).to_bytes(4, "big") + data)


def recv_frame(sock: socket.socket) -> tuple[Any, ...]:
    size = int.from_bytes(_recv_exactly(sock, 4), "big")
    msg = marshal.loads(_recv_exactly(sock, size))  # from our own server, never from the child
    if not isinstance(msg, tuple):
        raise ValueError("malformed answer from the fork server")
    return msg


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError("the fork server closed its socket")
        buf += chunk
    return bytes(buf)
