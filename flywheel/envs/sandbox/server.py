"""The fork server: one helper process per Python process that runs calls, started by
``client.py``; also the entry point of spawn mode's one-shot launcher.

Requests arrive on a socketpair as frames (a 4-byte length and a marshal payload):
``(id, code, private dir, cpu_s, memory_mb, file_size_mb, max_output_chars, timeout_s,
disk_mb)``. For each the server forks the call's init into a new PID namespace
(``launch.Launcher``), reads the code's stdout (the first bytes) and stderr (the last bytes),
kills the init at the wall-clock deadline (counted from when the request arrives; the kernel
then kills the whole namespace), reaps it and answers ``(id, True, (timed_out, returncode,
stdout, stderr))``, or ``(id, False, why)`` when it could not start the call. The returncode
is the code's process's (the init hands over its wait status on a pipe). The server exits,
killing its calls, when its end of the socketpair closes, so also when its parent dies.
The first frame it sends is ``("ready", pid)``, or ``("failed", why)`` when it cannot isolate
itself, in which case it exits.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import select
import signal
import sys
import time
from typing import Any

from flywheel.envs.sandbox.launch import Launcher, isolate, library_paths, spawn_one

_STDERR_TAIL = 4096


class _Kid:
    def __init__(self, rid: int, pid: int, fds: tuple[int, int, int], deadline: float, keep: int):
        self.rid, self.pid, self.deadline, self.keep = rid, pid, deadline, keep
        self.out_fd, self.err_fd, self.status_fd = fds
        self.out, self.err = bytearray(), bytearray()
        self.open = {self.out_fd, self.err_fd}  # output pipes not at EOF yet
        self.pidfd: int | None = None  # readable when the init exits
        self.rc: int | None = None  # the code's process's return code, once known
        self.timed_out = False
        self.reaped = False
        self.init_status = 0

    def watched(self) -> list[int]:
        return [*self.open, self.status_fd, *([] if self.pidfd is None else [self.pidfd])]


def _send(fd: int, msg: tuple[Any, ...]) -> None:
    data = marshal.dumps(msg)
    view = memoryview(len(data).to_bytes(4, "big") + data)
    while view:
        view = view[os.write(fd, view) :]


def _kill(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)  # the init: the kernel kills its namespace with it


class Server:
    """The loop: requests in, calls started, pipes read, deadlines kept, answers out."""

    def __init__(self, ctl: int, launcher: Launcher) -> None:
        self.ctl, self.launcher = ctl, launcher
        self.poll = select.poll()
        self.poll.register(ctl, select.POLLIN)
        self.kids: dict[int, _Kid] = {}  # pid -> call
        self.exiting: dict[int, _Kid] = {}  # pid -> answered call whose init has not exited
        self.owner: dict[int, _Kid] = {}  # pipe -> call
        self.inbox = bytearray()

    def forget(self) -> None:
        """In a call's init: other calls' code and output, in our copy of the server's memory."""
        self.kids.clear()
        self.exiting.clear()
        self.owner.clear()
        self.inbox.clear()

    def start(self, req: tuple[Any, ...]) -> None:
        pipes = [os.pipe(), os.pipe(), os.pipe()]  # stdout, stderr, the code's wait status
        ours = tuple(r for r, _ in pipes)
        for fd in ours:
            os.set_blocking(fd, False)  # our ends only; the child's stay blocking
        deadline = time.monotonic() + req[7]
        try:
            call = self.launcher.call(req, os.path.realpath(req[2]))
            (_, out), (_, err), (_, status) = pipes
            pid = self.launcher.fork(call, out, err, status, forget=self.forget)
        except OSError as e:
            for r, w in pipes:
                os.close(r)
                os.close(w)
            _send(self.ctl, (req[0], False, f"fork failed: {e}"))
            return
        for _, w in pipes:
            os.close(w)
        kid = _Kid(req[0], pid, ours, deadline, 4 * req[6] + 4)  # type: ignore[arg-type]
        self.kids[pid] = kid
        try:
            kid.pidfd = os.pidfd_open(pid)
        except OSError:
            kid.pidfd = None
        for fd in kid.watched():
            self.poll.register(fd, select.POLLIN)
            self.owner[fd] = kid

    def close(self, kid: _Kid, fd: int) -> None:
        self.poll.unregister(fd)
        os.close(fd)
        del self.owner[fd]
        kid.open.discard(fd)

    def read(self, kid: _Kid, fd: int) -> bool:
        """Read one chunk; True when the pipe has nothing more for now."""
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return True
        if not chunk:
            self.close(kid, fd)
            return True
        if fd == kid.out_fd:  # keep reading past the cap so the child never blocks on a full pipe
            kid.out += chunk[: max(0, kid.keep - len(kid.out))]
        else:
            kid.err += chunk
            del kid.err[:-_STDERR_TAIL]
        return False

    def reap(self, kid: _Kid) -> bool:
        """Reap the call's init if it has exited (its namespace torn down); True once done."""
        if not kid.reaped:
            pid, status = os.waitpid(kid.pid, os.WNOHANG)
            if pid == 0:
                return False
            kid.reaped, kid.init_status = True, status
            if kid.pidfd is not None:
                self.close(kid, kid.pidfd)
                kid.pidfd = None
        return True

    def code_status(self, kid: _Kid) -> int | None:
        """The wait status the init hands over once the code's process is gone (and, with
        it, every other process of the call: the init kills and reaps them first)."""
        if kid.status_fd < 0:
            return None
        try:
            data = os.read(kid.status_fd, 4)
        except BlockingIOError:
            return None
        self.close(kid, kid.status_fd)
        kid.status_fd = -1
        return int.from_bytes(data, "little") if len(data) == 4 else None

    def sweep(self, kid: _Kid, now: float) -> None:
        if kid.rc is None:
            if not kid.timed_out and now >= kid.deadline:
                kid.timed_out = True
                _kill(kid.pid)
            status = self.code_status(kid)
            if status is None:
                if not self.reap(kid):
                    return
                status = self.code_status(kid)
            kid.rc = os.waitstatus_to_exitcode(kid.init_status if status is None else status)
        if kid.open and not kid.timed_out and now >= kid.deadline:
            kid.timed_out = True  # exited, but something still holds its pipes
        if kid.timed_out:
            for fd in list(kid.open):
                for _ in range(64):  # what is in the pipe now, not what a stray writer adds
                    if self.read(kid, fd):
                        break
                if fd in kid.open:
                    self.close(kid, fd)
        if not kid.open:
            result = (kid.timed_out, kid.rc, bytes(kid.out), bytes(kid.err))
            _send(self.ctl, (kid.rid, True, result))
            del self.kids[kid.pid]
            if not self.reap(kid):  # its namespace's teardown need not delay the answer
                self.exiting[kid.pid] = kid

    def receive(self) -> bool:
        """Start every complete request that arrived; False when our parent is gone."""
        chunk = os.read(self.ctl, 65536)
        if not chunk:
            return False
        inbox = self.inbox
        inbox.extend(chunk)
        while len(inbox) >= 4 and len(inbox) >= 4 + int.from_bytes(inbox[:4], "big"):
            size = int.from_bytes(inbox[:4], "big")
            req = marshal.loads(bytes(inbox[4 : 4 + size]))
            del inbox[: 4 + size]
            try:
                self.start(req)
            except Exception as e:  # e.g. out of descriptors: spawn mode will try
                _send(self.ctl, (req[0], False, f"{type(e).__name__}: {e}"))
        return True

    def serve(self) -> None:
        _send(self.ctl, ("ready", os.getpid()))
        try:
            while True:
                now = time.monotonic()
                wait = 3600.0
                for kid in self.kids.values():
                    if kid.rc is None and kid.pidfd is None:
                        wait = min(wait, 0.01)  # no pidfd to wake us at its exit: look often
                    if not kid.timed_out:
                        wait = min(wait, kid.deadline - now)
                for fd, _ in self.poll.poll(max(0.0, wait) * 1000):
                    if fd == self.ctl:
                        if not self.receive():
                            return
                    elif fd in self.owner and fd in self.owner[fd].open:
                        self.read(self.owner[fd], fd)
                now = time.monotonic()
                for kid in list(self.kids.values()):
                    self.sweep(kid, now)
                for kid in list(self.exiting.values()):
                    if self.reap(kid):
                        del self.exiting[kid.pid]
        finally:
            for kid in (*self.kids.values(), *self.exiting.values()):
                _kill(kid.pid)
            for kid in (*self.kids.values(), *self.exiting.values()):
                if not kid.reaped:
                    os.waitpid(kid.pid, 0)


def main(argv: list[str]) -> None:
    """``serve FD`` (the fork server) or ``spawn DIR CPU MEM FSIZE CHARS DISK`` (one call)."""
    try:
        if argv[0] == "spawn":
            spawn_one(argv[1:])
        ctl = int(argv[1])
        read_paths = library_paths()
        try:
            launcher = Launcher(read_paths, isolate(read_paths))
        except OSError as e:
            _send(ctl, ("failed", f"cannot isolate the sandbox: {e}"))
            return
        Server(ctl, launcher).serve()
    finally:
        sys.stdout.flush()
        os._exit(0)
