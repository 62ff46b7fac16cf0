"""What runs inside one call: its init process and the process that runs the code.

The fork server (or, in spawn mode, a fresh interpreter) forks each call into a new PID
namespace, so the first process of a call is that namespace's init (pid 1). ``call_init``:

1. asks the kernel to SIGKILL it if the server dies, and checks the server is still there;
2. makes its own mount namespace, mounts a tmpfs of ``disk_mb`` on the call's private
   directory (the disk budget: the whole call's files live there, in memory, and vanish with
   the namespace) and a fresh, read-only ``/proc`` that shows only this namespace's processes;
3. forks the code's process (pid 2), waits for it, hands its wait status to the server, and
   exits. When the init exits the kernel kills whatever is left in the namespace, so nothing
   a call starts outlives it.

The code's process (``lock_down``, then ``run_and_exit``) sets its resource limits, drops to
the ``nobody`` user with no capabilities left in any set, sets no_new_privs, confines itself
with Landlock (reads: the Python library and system directories; writes: the private
directory) and a seccomp filter (``seccomp.py``), then runs the code in a fresh ``__main__``.
None of this depends on Python-level hooks: native code, ctypes or a sub-interpreter meet the
same kernel checks.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sys
import types
from dataclasses import dataclass
from typing import Any

from flywheel.envs.sandbox import kernel, seccomp

NOBODY = 65534
# Read-only system directories the code may read besides Python's own library directories
# (no /etc, /home, /root, /work, /tmp: configuration, secrets and other runs' data).
SYSTEM_READ = ("/usr", "/lib", "/lib64", "/bin", "/proc")
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/dev/full")
MAX_FILES = 4096  # inodes in the private tmpfs
MAX_OPEN_FILES = 256


@dataclass(frozen=True)
class Call:
    """One call's code and limits, as the server receives them."""

    code: str
    root: str  # the private directory: cwd, TMPDIR, and the only place writes go
    cpu_s: int
    memory_mb: int
    file_size_mb: int
    max_output_chars: int
    disk_mb: int
    read_paths: tuple[str, ...]  # Python's library directories
    as_nobody: bool  # root outside any user namespace: switch to uid and gid 65534


def call_init(call: Call, out: int, err: int, status: int, server: int) -> None:
    """Run as pid 1 of the call's PID namespace; never returns."""
    try:
        kernel.set_parent_death_signal(signal.SIGKILL)
        if _host_parent_pid() != server:
            os._exit(1)  # the server died before we asked to die with it
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        kernel.unshare(kernel.CLONE_NEWNS)
        hidden = kernel.MS_NOSUID | kernel.MS_NODEV | kernel.MS_NOEXEC
        size = f"size={max(1, call.disk_mb)}m,nr_inodes={MAX_FILES},mode=0700"
        owner = f",uid={NOBODY},gid={NOBODY}" if call.as_nobody else ""
        kernel.mount("tmpfs", call.root, "tmpfs", hidden, size + owner)
        kernel.mount("proc", "/proc", "proc", hidden | kernel.MS_RDONLY)
        pid = os.fork()
    except BaseException as e:
        _fail(err, e)
    if pid == 0:
        try:
            os.close(status)
            lock_down(call, out, err)
        except BaseException as e:
            _fail(err, e)
        run_and_exit(call.code)
    os.close(out)
    os.close(err)
    while True:
        try:
            reaped, wait_status = os.wait()
        except ChildProcessError:
            os._exit(1)
        if reaped == pid:
            break
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)  # anything else in the namespace (none, unless a layer failed)
    while True:
        try:
            os.wait()
        except ChildProcessError:
            break  # every process of the call is gone: the server may answer now
    os.write(status, wait_status.to_bytes(4, "little"))
    os._exit(0)


def _host_parent_pid() -> int:
    # getppid() says 0 in a new PID namespace; the host's /proc (not yet replaced) knows
    with open("/proc/self/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[1])


def _fail(err: int, e: BaseException) -> None:
    line = f"\nsandbox setup failed: {type(e).__name__}: {e}\n"
    os.write(err, line.encode("utf-8", "replace"))
    os._exit(1)


def lock_down(call: Call, out: int, err: int) -> None:
    """Confine this process for good: limits, user, capabilities, Landlock, seccomp."""
    os.dup2(out, 1)
    os.dup2(err, 2)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the server's socket, other calls' pipes
    os.chdir(call.root)
    os.environ.clear()
    os.environ.update({"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "TMPDIR": call.root})
    os.environ["HOME"] = call.root
    sys.argv = ["<tool>"]
    set_limits(call)
    nobody = NOBODY if call.as_nobody else None
    kernel.drop_privileges(nobody, nobody)
    kernel.set_no_new_privs()
    everything = kernel.landlock_fs_rights(kernel.landlock_abi()) & ~kernel.FS_EXECUTE
    rules = [(".", everything)]  # the private directory, our cwd: its parents may be closed to us
    rules += [(p, kernel.FS_READ) for p in (*call.read_paths, *SYSTEM_READ, *DEVICES)]
    kernel.landlock_restrict(rules)
    if seccomp.supported():
        seccomp.install()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stdout = _Capped(sys.stdout, call.max_output_chars)
    sys.stderr = _Capped(sys.stderr, -1)


def set_limits(call: Call) -> None:
    """Per-process limits; RLIMIT_NPROC of 1 means no new process or thread once not root."""
    cpu, mem, fsz = call.cpu_s, call.memory_mb << 20, call.file_size_mb << 20
    for res, soft, hard in (
        (resource.RLIMIT_CPU, cpu, cpu + 1),  # soft: SIGXCPU; hard a second later: SIGKILL
        (resource.RLIMIT_AS, mem, mem),
        (resource.RLIMIT_FSIZE, fsz, fsz),
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_NPROC, 1, 1),
        (resource.RLIMIT_NOFILE, MAX_OPEN_FILES, MAX_OPEN_FILES),
        (resource.RLIMIT_MEMLOCK, 0, 0),
        (resource.RLIMIT_MSGQUEUE, 0, 0),
    ):
        resource.setrlimit(res, (soft, hard))


class _Capped:
    """Forwards the first cap + 1 characters (one more than kept, so the parent sees the
    truncation) and drops the rest, so a print loop costs no pipe traffic."""

    def __init__(self, raw: Any, cap: int) -> None:
        self._raw, self._left = raw, cap + 1

    def write(self, s: str) -> int:
        if self._left > 0:
            self._raw.write(s[: self._left])
            self._left -= len(s)
            if self._left <= 0:
                self._raw.flush()
        return len(s)

    def flush(self) -> None:
        self._raw.flush()

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def _run(src: str) -> tuple[int, str]:
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    try:
        exec(compile(src, "<tool>", "exec"), main.__dict__)
        return 0, ""
    except SystemExit as e:
        return (0, "") if e.code in (None, 0) else (1, f"SystemExit: {e.code}")
    except MemoryError:
        return 1, "MemoryError"
    except BaseException as e:
        return 1, type(e).__name__ + (f": {e}" if str(e) else "")


def run_and_exit(src: str) -> None:
    """Run the code; its last error line goes to stderr; exit without cleanup handlers."""
    try:
        status, line = _run(src)
    except BaseException as e:  # e.g. an exception whose str() raises
        status, line = 1, type(e).__name__
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
    if status:
        os.write(2, ("\n" + " ".join(line.split()) + "\n").encode("utf-8", "replace"))
    os._exit(status)
