"""Run untrusted Python written by the agent, in a locked-down child process.

Tool-integrated environments (``arith``) hand the code of a ``<python>`` action to ``run_python``
and show the agent the captured stdout, or a one-line error::

    from flywheel.envs.sandbox import run_python
    result = run_python("print(37 + 12)", timeout_s=2.0)
    result.status, result.output, result.error   # ("ok", "49\\n", "")

Each call starts a fresh ``python -I -S -B`` (isolated mode, no site-packages: only the standard
library is importable, startup is fast). A bootstrap script passed with ``-c`` locks the child
down before the user code runs:

- resource limits: CPU seconds, address space (memory), file size, no core files, no processes;
- a fresh network namespace when the kernel permits it (root with CAP_SYS_ADMIN, or user
  namespaces), so there is no network interface at all;
- Landlock when the kernel has it (Linux >= 5.13, unprivileged): the kernel itself refuses
  writes outside the private directory, exec, TCP bind/connect and signals to other processes;
- an audit hook (``sys.addaudithook``, which cannot be removed once installed) that refuses to
  fork, exec, spawn, signal other processes, create sockets, load native code through ctypes,
  raise resource limits, and write, create, rename or delete files outside the private
  temporary directory. As root, RLIMIT_NPROC is not enforced and the namespace and Landlock may
  be missing, so the hook is the layer that is always there. Its decisions use only functions
  captured at startup, so monkeypatching ``os.path`` or builtins does not fool it.

An audit hook fences in code that misbehaves by accident, which is what a policy's tool calls
do; it is not a proven boundary against code crafted to escape CPython. Reading files is not
restricted. Run third-party models' code inside a container as well.

The parent gives the child a private temporary directory as cwd (deleted afterwards), a minimal
environment (no secrets from ours), reads at most a few kilobytes of its output, and kills the
child's whole process group when the wall-clock timeout passes. ``run_python`` never raises for
anything the code does; it always returns a ``SandboxResult``.

Thread safety: every call owns its process, pipes and directory, and no ``preexec_fn`` is used
(it is unsafe with threads and disables the fast vfork path), so calls can run from a thread
pool. A process-wide semaphore bounds how many children run at once, so a large pool cannot
oversubscribe the CPUs or the memory; waiting for a slot does not count against the timeout.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import IO, Literal

Status = Literal["ok", "error", "timeout", "killed"]

# Each child is one CPU-bound process; more than two per core only adds context switching and
# memory pressure (each may use up to ``memory_mb``).
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


# Runs in the child before the user code; argv: tempdir, cpu_s, memory_mb, file_size_mb,
# max_output_chars; the user code comes on stdin. Kept as one string so that nothing of ours has
# to be importable by the isolated interpreter.
_BOOTSTRAP = r"""
import os, posix, resource, signal, _signal, sys, types
_tmp, _cpu, _mem, _fsz, _cap = sys.argv[1], *map(int, sys.argv[2:6])
_src = sys.stdin.read()
sys.stdin.close()
sys.argv = ["<tool>"]
os.environ["TMPDIR"] = _tmp


def _os_layers(root):
    # Best effort: a network namespace without interfaces, then Landlock (Linux >= 5.13, works
    # unprivileged) denying writes outside root, exec, TCP and signals to other processes.
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
    except (ImportError, OSError):
        return
    if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET needs CAP_SYS_ADMIN...
        libc.unshare(0x10000000 | 0x40000000)  # ...or a new user namespace
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(444, None, 0, 1)  # landlock_create_ruleset(VERSION)
    if abi < 1:
        return
    # execute, write, remove dir/file, make char/dir/reg/sock/fifo/block/sym, refer, truncate
    fs = sum(1 << b for b in (0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12))
    fs |= (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)
    attr = (ctypes.c_uint64 * 3)(fs, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)
    ruleset = libc.syscall(444, ctypes.byref(attr), 8 if abi < 4 else 16 if abi < 6 else 24, 0)
    if ruleset < 0:
        return

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    dirfd = os.open(root, os.O_PATH | os.O_CLOEXEC)
    rule = PathBeneath(fs & ~1, dirfd)  # everything but exec inside the private directory
    if libc.syscall(445, ruleset, 1, ctypes.byref(rule), 0) == 0 and libc.prctl(38, 1, 0, 0, 0) == 0:
        libc.syscall(446, ruleset, 0)  # landlock_restrict_self, after PR_SET_NO_NEW_PRIVS
    os.close(dirfd)
    os.close(ruleset)


def _limits(cpu, mem, fsz):
    for res, soft, hard in (
        (resource.RLIMIT_CPU, cpu, cpu + 1),  # soft: SIGXCPU; hard a second later: SIGKILL
        (resource.RLIMIT_AS, mem << 20, mem << 20),
        (resource.RLIMIT_FSIZE, fsz << 20, fsz << 20),
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_NPROC, 0, 0),  # not enforced for root; the hook covers it
    ):
        try:
            resource.setrlimit(res, (soft, hard))
        except (ValueError, OSError):
            pass


def _make_hook(root, getcwd, lstat, readlink, type, str, bytes, int, PermissionError, OSError):
    # Everything the hook uses is bound here, in closure cells, so that user code that
    # monkeypatches builtins or os.path cannot change its decisions.
    blocked = frozenset((
        "os.fork", "os.forkpty", "os.exec", "os.spawn", "os.posix_spawn", "os.system",
        "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill",
        "socket.__new__", "socket.bind", "socket.connect", "socket.sendto", "socket.sendmsg",
        "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
        "resource.setrlimit", "resource.prlimit", "os.symlink", "os.link", "os.chroot",
        # the garbage collector would hand out this hook, whose closure cells are writable
        "gc.get_objects", "gc.get_referrers", "gc.get_referents",
    ))
    # _posixsubprocess.fork_exec has no audit event; the others would undo our stripping.
    blocked_imports = frozenset((
        "_posixsubprocess", "_ctypes", "ctypes", "_multiprocessing", "os", "posix", "signal",
        "_signal",
    ))
    # event -> (indices of path arguments, indices of dir_fd arguments)
    path_events = {
        "os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)), "os.mkdir": ((0,), (2,)),
        "os.rename": ((0, 1), (2, 3)), "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)),
        "os.utime": ((0,), (3,)), "os.truncate": ((0,), ()), "shutil.rmtree": ((0,), (1,)),
        "os.setxattr": ((0,), ()), "os.removexattr": ((0,), ()),
    }
    write_flags = 0o1 | 0o2 | 0o100 | 0o1000 | 0o2000  # WRONLY RDWR CREAT TRUNC APPEND

    def resolve(p):
        # os.path.realpath, written against the captured posix functions
        if type(p) is bytes:
            p = p.decode("utf-8", "surrogateescape")
        elif type(p) is not str:
            return None  # a path-like object's __fspath__ could answer differently twice
        if not p.startswith("/"):
            p = getcwd() + "/" + p
        todo, done, hops = p.split("/"), [], 0
        todo.reverse()
        while todo:
            part = todo.pop()
            if part in ("", "."):
                continue
            if part == "..":
                if done:
                    done.pop()
                continue
            here = "/" + "/".join(done + [part])
            try:
                is_link = lstat(here).st_mode & 0o170000 == 0o120000
            except OSError:
                is_link = False
            if not is_link:
                done.append(part)
                continue
            hops += 1
            if hops > 40:
                return None
            target = readlink(here)
            if target.startswith("/"):
                done = []
            more = target.split("/")
            more.reverse()
            todo += more
        return "/" + "/".join(done)

    def inside(p):
        r = resolve(p)
        return r is not None and (r == root or r.startswith(root + "/"))

    def hook(event, args):
        if event in blocked or event.startswith("ctypes."):
            raise PermissionError(event + " is not allowed in the sandbox")
        if event == "import":
            if args[0] in blocked_imports:
                raise PermissionError("import " + args[0] + " is not allowed in the sandbox")
        elif event == "open":
            path, mode, flags = args
            if flags & write_flags and type(path) is not int:
                # os.open (mode None) may be relative to a dir_fd that the event does not show
                relative = type(path) is str and not path.startswith("/")
                if (mode is None and relative) or not inside(path):
                    raise PermissionError("writing outside the sandbox directory is not allowed")
        elif event in path_events:
            paths, dir_fds = path_events[event]
            if event == "os.truncate" and type(args[0]) is int:
                return  # ftruncate needs a file already opened for writing
            for i in dir_fds:
                if i < len(args) and args[i] is not None and args[i] != -1:
                    raise PermissionError(event + " with dir_fd is not allowed in the sandbox")
            for i in paths:
                if not inside(args[i]):
                    raise PermissionError(event + " outside the sandbox directory is not allowed")

    return hook


class _Capped:
    # Forwards the first cap + 1 characters (one more than kept, so the parent sees the
    # truncation) and drops the rest, so a print loop costs no pipe traffic.
    def __init__(self, raw, cap):
        self._raw, self._left = raw, cap + 1

    def write(self, s):
        if self._left > 0:
            self._raw.write(s[: self._left])
            self._left -= len(s)
            if self._left <= 0:
                self._raw.flush()
        return len(s)

    def flush(self):
        self._raw.flush()

    def isatty(self):
        return False

    def __getattr__(self, name):
        return getattr(self._raw, name)


def _install(root):
    # pidfd_send_signal can signal any process without an audit event
    for mod, name in ((signal, "pidfd_send_signal"), (_signal, "pidfd_send_signal"),
                      (os, "pidfd_open"), (posix, "pidfd_open")):
        mod.__dict__.pop(name, None)
    for name in [m for m in sys.modules if m.split(".")[0] in ("ctypes", "_ctypes")]:
        del sys.modules[name]
    sys.addaudithook(_make_hook(root, posix.getcwd, posix.lstat, posix.readlink, type, str,
                                bytes, int, PermissionError, OSError))


def _run(src):
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    try:
        exec(compile(src, "<tool>", "exec"), main.__dict__)
        return 0, ""
    except SystemExit as e:
        return (0, "") if e.code in (None, 0) else (1, "SystemExit: " + str(e.code))
    except MemoryError:
        return 1, "MemoryError"
    except BaseException as e:
        return 1, type(e).__name__ + (": " + str(e) if str(e) else "")


_os_layers(os.path.realpath(_tmp))
_limits(_cpu, _mem, _fsz)
sys.stdout.reconfigure(line_buffering=True)  # what was printed survives a kill
sys.stdout = _Capped(sys.stdout, _cap)
sys.stderr = _Capped(sys.stderr, -1)
_install(os.path.realpath(_tmp))
try:
    _status, _line = _run(_src)
except BaseException as e:  # e.g. an exception whose str() raises
    _status, _line = 1, type(e).__name__
try:
    sys.stdout.flush()
except BaseException:
    pass
if _status:
    os.write(2, ("\n" + " ".join(_line.split()) + "\n").encode("utf-8", "replace"))
os._exit(_status)
"""


def run_python(
    code: str,
    *,
    timeout_s: float = 5.0,
    cpu_s: int = 2,
    memory_mb: int = 512,
    file_size_mb: int = 1,
    max_output_chars: int = 2000,
) -> SandboxResult:
    """Run ``code`` in a sandboxed child interpreter and return what happened (never raises).

    ``timeout_s`` is wall-clock time from the start of the child (interpreter startup included);
    ``cpu_s`` its CPU seconds; ``memory_mb`` its address space; ``file_size_mb`` the largest file
    it may write (inside its private directory); ``max_output_chars`` how much stdout is kept.
    """
    with _slots:
        tmp = tempfile.mkdtemp(prefix="flywheel-sandbox-")
        try:
            return _spawn(code, tmp, timeout_s, cpu_s, memory_mb, file_size_mb, max_output_chars)
        except Exception as e:  # a failure of ours (spawn, pipes), not of the user code
            return SandboxResult(
                "error", "", _one_line(f"sandbox failure: {type(e).__name__}: {e}")
            )
        finally:
            _remove_tree(tmp)


def _spawn(
    code: str,
    tmp: str,
    timeout_s: float,
    cpu_s: int,
    memory_mb: int,
    file_size_mb: int,
    max_output_chars: int,
) -> SandboxResult:
    limits = (max(1, int(cpu_s)), int(memory_mb), int(file_size_mb), int(max_output_chars))
    argv = [sys.executable, "-I", "-S", "-B", "-c", _BOOTSTRAP, tmp, *map(str, limits)]
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "TMPDIR": tmp}
    deadline = time.monotonic() + timeout_s
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp,
        env=env,
        start_new_session=True,  # its own process group, so a timeout kills all it started
        bufsize=0,
    )
    feeder: threading.Thread | None = None
    try:
        # A source larger than the pipe buffer must not block us past the deadline.
        source = code.encode("utf-8", "replace")
        feeder = threading.Thread(target=_feed, args=(proc.stdin, source), daemon=True)
        feeder.start()
        stdout, stderr, timed_out = _collect(proc, deadline, 4 * max_output_chars + 4)
        if not timed_out:
            timed_out = not _wait_unreaped(proc.pid, deadline)
    finally:
        # Kill the group while the unreaped leader still holds the group id, so the id
        # cannot have been reused by an unrelated process.
        _kill_group(proc.pid)
        proc.wait()
        if feeder is not None and feeder.ident is not None:
            feeder.join(timeout=1.0)  # with the child dead, its write fails at once
        pipes = [proc.stdout, proc.stderr]
        if feeder is None or not feeder.is_alive():  # else the feeder still owns stdin
            pipes.append(proc.stdin)
        for pipe in pipes:
            if pipe is not None:
                pipe.close()

    text = stdout.decode("utf-8", "replace")
    truncated = len(text) > max_output_chars
    text = text[:max_output_chars]
    if timed_out:
        return SandboxResult("timeout", text, f"timeout after {timeout_s} s", truncated)
    rc = proc.returncode
    if rc == 0:
        return SandboxResult("ok", text, "", truncated)
    if rc < 0:
        return SandboxResult("killed", text, _signal_message(-rc), truncated)
    lines = stderr.decode("utf-8", "replace").strip().splitlines()
    line = lines[-1] if lines else f"exit code {rc}"
    if line.startswith("MemoryError"):
        line = "memory limit exceeded"
    return SandboxResult("error", text, _one_line(line), truncated)


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
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.data is out:
                    # keep reading past the cap so the child never blocks on a full pipe
                    out += chunk[: max(0, max_bytes - len(out))]
                else:
                    err += chunk
                    del err[:-_STDERR_TAIL_BYTES]
    return bytes(out), bytes(err), False


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _signal_message(signum: int) -> str:
    if signum == signal.SIGXCPU:
        return "cpu time limit exceeded"
    if signum == signal.SIGXFSZ:
        return "file size limit exceeded"
    if signum == signal.SIGKILL:
        return "killed (cpu time or memory limit)"
    try:
        return f"killed by {signal.Signals(signum).name}"
    except ValueError:
        return f"killed by signal {signum}"


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _ERROR_LINE_CHARS else line[: _ERROR_LINE_CHARS - 3] + "..."


def _remove_tree(path: str) -> None:
    # The code may have made entries unreadable (chmod 000); restore permissions and retry.
    def retry(func, p, _exc):  # type: ignore[no-untyped-def]
        try:
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            os.chmod(p, stat.S_IRWXU)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=retry)
