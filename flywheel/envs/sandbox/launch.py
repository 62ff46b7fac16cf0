"""Where calls start: the helper's namespaces and view, and one call's PID namespace.

Runs in a helper interpreter (``python -I -S -B``: the fork server, or spawn mode's one-shot
launcher) that imports only this package's kernel-facing modules. ``isolate`` gives it, once,
its own mount, network, IPC and UTS namespaces: the network namespace has no interface but a
downed loopback, and the mount view is read-only and nosuid everywhere. ``Launcher.fork``
starts each call's init in a fresh PID namespace, which adds its own mounts
(``child.call_init``).
"""

from __future__ import annotations

import gc
import os
import resource
import signal
import stat
import sys
from typing import Any

from flywheel.envs.sandbox import kernel, seccomp
from flywheel.envs.sandbox.child import Call, call_init


def isolate(read_paths: tuple[str, ...]) -> bool:
    """Own namespaces and a read-only view for this process; True if calls run as nobody.

    As root, calls switch to the ``nobody`` user. Otherwise a user namespace gives this process
    the capabilities for the rest, and calls keep our uid with every capability dropped.
    """
    as_nobody = os.geteuid() == 0 and _has_cap_sys_admin()
    if not as_nobody:
        uid, gid = os.geteuid(), os.getegid()
        kernel.unshare(kernel.CLONE_NEWUSER)
        for name, text in (
            ("setgroups", "deny"),
            ("uid_map", f"0 {uid} 1"),
            ("gid_map", f"0 {gid} 1"),
        ):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    flags = kernel.CLONE_NEWNS | kernel.CLONE_NEWNET | kernel.CLONE_NEWIPC | kernel.CLONE_NEWUTS
    kernel.unshare(flags)
    kernel.mount(None, "/", None, kernel.MS_REC | kernel.MS_PRIVATE)
    if as_nobody:
        _make_reachable(read_paths)
    kernel.set_mount_attrs_recursive("/", kernel.MOUNT_ATTR_RDONLY | kernel.MOUNT_ATTR_NOSUID)
    return as_nobody


def _has_cap_sys_admin() -> bool:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 21 & 1)
    return False


def _make_reachable(paths: tuple[str, ...]) -> None:
    """Let ``nobody`` reach Python's library directories, in our mount namespace only.

    A directory on the way that others may not enter (``/root`` of a pyenv install, mode 700)
    is covered with an empty tmpfs holding only the entries on the way, bind-mounted back.
    Everything else in that directory stays out of sight.
    """
    blocked: dict[str, set[str]] = {}
    for path in paths:
        parts = os.path.realpath(path).strip("/").split("/")
        for i in range(len(parts) - 1):
            here = "/" + "/".join(parts[:i])
            if not os.stat(here).st_mode & stat.S_IXOTH:
                blocked.setdefault(here, set()).add(parts[i])
                break
    for here, names in blocked.items():
        keep = {name: os.open(os.path.join(here, name), os.O_PATH) for name in names}
        try:
            kernel.mount("tmpfs", here, "tmpfs", kernel.MS_NOSUID | kernel.MS_NODEV, "mode=0755")
            for name, fd in keep.items():
                target = os.path.join(here, name)
                if stat.S_ISDIR(os.fstat(fd).st_mode):
                    os.mkdir(target)
                else:
                    os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
                kernel.mount(f"/proc/self/fd/{fd}", target, None, kernel.MS_BIND | kernel.MS_REC)
        finally:
            for fd in keep.values():
                os.close(fd)


def library_paths() -> tuple[str, ...]:
    """Python's own library directories (this interpreter runs without site-packages)."""
    return tuple(os.path.realpath(p) for p in sys.path if p and os.path.isdir(p))


class Launcher:
    """Starts calls, each as the init of a new PID namespace."""

    def __init__(self, read_paths: tuple[str, ...], as_nobody: bool) -> None:
        self.read_paths, self.as_nobody = read_paths, as_nobody
        self.me = os.getpid()
        self._pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        kernel.last_capability()  # read once here rather than in every call
        if seccomp.supported():
            seccomp.prepare()

    def call(self, req: tuple[Any, ...], root: str) -> Call:
        _, code, _, cpu, mem, fsz, cap, _, disk = req
        return Call(code, root, cpu, mem, fsz, cap, disk, self.read_paths, self.as_nobody)

    def fork(self, call: Call, out: int, err: int, status: int, forget: Any = None) -> int:
        """Fork the call's init (pid 1 of a fresh PID namespace); returns its pid here."""
        gc.freeze()  # the child's collections skip our objects instead of copying their pages
        kernel.unshare(kernel.CLONE_NEWPID)  # for our next child only
        try:
            pid = os.fork()
        except BaseException:
            kernel.setns(self._pidns, kernel.CLONE_NEWPID)
            raise
        if pid == 0:
            try:
                if forget is not None:
                    forget()
                call_init(call, out, err, status, self.me)
            finally:
                os._exit(1)
        kernel.setns(self._pidns, kernel.CLONE_NEWPID)  # later children: our namespace again
        return pid


def read_status(fd: int) -> int | None:
    try:
        data = os.read(fd, 4)
    except BlockingIOError:
        return None
    return int.from_bytes(data, "little") if len(data) == 4 else None


def spawn_one(argv: list[str]) -> None:
    """Spawn mode: isolate, run one call (code on stdin), exit as its code's process did.

    argv: private directory, cpu_s, memory_mb, file_size_mb, max_output_chars, disk_mb.
    """
    code = sys.stdin.read()
    tmp, *limits = argv
    read_paths = library_paths()
    try:
        launcher = Launcher(read_paths, isolate(read_paths))
    except OSError as e:  # no root, no user namespaces: refuse rather than run with less
        os.write(2, f"\nsandbox setup failed: cannot isolate the sandbox: {e}\n".encode())
        os._exit(1)
    numbers = [int(x) for x in limits]
    req = (0, code, tmp, *numbers[:4], 0, numbers[4])
    status_r, status_w = os.pipe()
    pid = launcher.fork(launcher.call(req, os.path.realpath(tmp)), os.dup(1), os.dup(2), status_w)
    os.close(status_w)
    code_status = read_status(status_r)  # the init's namespace teardown need not delay us
    if code_status is None:
        _, code_status = os.waitpid(pid, 0)
    rc = os.waitstatus_to_exitcode(code_status)
    if rc >= 0:
        os._exit(rc)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(-rc, signal.SIG_DFL)
    os.kill(os.getpid(), -rc)
    os._exit(128 - rc)
