"""Run untrusted Python written by the agent, in a locked-down child process.

Tool-integrated environments (``arith``) hand the code of a ``<python>`` action to ``run_python``
and show the agent the captured stdout, or a one-line error::

    from flywheel.envs.sandbox import run_python
    result = run_python("print(37 + 12)", timeout_s=2.0)
    result.status, result.output, result.error   # ("ok", "49\\n", "")

Every call runs in its own child process, locked down before the user code runs:

- resource limits: CPU seconds, address space (memory), file size, no core files, no processes;
- a network namespace without interfaces when the kernel permits it (root with CAP_SYS_ADMIN,
  or user namespaces), so there is no network at all;
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

The parent gives the child a private temporary directory as cwd (deleted afterwards) and a
minimal environment (no secrets from ours), keeps at most a few kilobytes of its output, and
kills the child's whole process group when the wall-clock timeout passes. ``run_python`` never
raises for anything the code does; it always returns a ``SandboxResult``.

Two ways to get the child (``mode``):

- ``spawn``: a fresh ``python -I -S -B`` per call (isolated mode, no site-packages). Simple, but
  interpreter startup costs ~20 ms of CPU and 25-40 ms of wall time per call on the 2-core dev
  box, which dominates the arith env.
- ``fork`` (default): a fork server: ~4 ms of CPU and 3-8 ms of wall time per call there
  (``benchmarks/bench_sandbox.py``; 4-9x less latency, 5-6x less CPU). On
  first use each Python process starts one helper, ``python -I -S -B`` with its own bootstrap,
  talking to us over a socketpair. Forking our own process would be unsafe (it has threads);
  the helper is single-threaded, holds no audit hook and has imported nothing that would hand
  the child a way around the hook (no ``subprocess``/``_posixsubprocess``; ctypes only for the
  syscalls below, dropped by the child before the hook goes in, as in ``spawn``). For each call
  it forks a child that joins a new process group, asks to be SIGKILLed if the helper dies,
  closes every inherited descriptor and forgets the other calls, then applies this call's
  limits, Landlock and hook (after the fork: limits are per call) and execs the code in a fresh
  ``__main__``. The helper reads the child's stdout/stderr, kills the child's group at the
  wall-clock deadline (counted from when the helper gets the request), reaps it and answers
  with the exit status and output. The helper makes the network namespace once, and every
  child inherits it, instead of one per call: one per call measured 20-50% slower (plus the
  kernel's deferred teardown of each namespace), and a namespace without interfaces gives no
  network whether fresh or shared (the hook forbids sockets anyway, and Landlock's scoping
  keeps children from reaching each other's abstract sockets or signalling each other).
  The helper exits, killing its children, when our end of the socketpair closes, so also when
  we are killed. It is restarted on the next call if it dies; a call it could not finish (it
  died or hung) is run again in ``spawn`` mode, and so is every call while it cannot start
  (retried after ``_SERVER_RETRY_S``).

Thread safety: every call owns its child, directory and (in ``spawn`` mode) pipes; the fork
server's socket is shared under a lock and answers are matched to calls by id, so calls can run
from a thread pool. A process-wide semaphore bounds how many children run at once, so a large
pool cannot oversubscribe the CPUs or the memory; waiting for a slot does not count against the
timeout. A process forked from ours (multiprocessing) starts its own fork server.

Benchmark: ``.venv/bin/python -m benchmarks.bench_sandbox``.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import marshal
import math
import os
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import IO, Any, Literal

Status = Literal["ok", "error", "timeout", "killed"]
Mode = Literal["fork", "spawn"]

# Each child is one CPU-bound process; more than two per core only adds context switching and
# memory pressure (each may use up to ``memory_mb``).
MAX_CONCURRENT = max(4, 2 * (os.cpu_count() or 1))
_slots = threading.BoundedSemaphore(MAX_CONCURRENT)

_ERROR_LINE_CHARS = 300
_STDERR_TAIL_BYTES = 4096
_ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}
_SERVER_START_S = 10.0  # the helper's interpreter startup, on a loaded machine
_SERVER_GRACE_S = 10.0  # past a call's timeout, a helper that has not answered is hung
_SERVER_RETRY_S = 30.0  # after a failed start, use spawn mode this long before trying again


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


# What every child runs to lock itself down and run the code, in both modes. Kept as source text
# so that nothing of ours has to be importable by the isolated interpreter.
_CHILD = r"""
import os, posix, resource, signal, _signal, sys, types


def _load_libc():
    # (ctypes, libc, Landlock's ruleset_attr and path_beneath_attr types), or None without
    # ctypes. Made once per interpreter: creating the types costs a fifth of a forked call.
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
    except (ImportError, OSError):
        return None
    libc.syscall.restype = ctypes.c_long

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    return ctypes, libc, ctypes.c_uint64 * 3, PathBeneath


def _unshare_net(libc):
    # CLONE_NEWNET needs CAP_SYS_ADMIN... or a new user namespace
    return libc.unshare(0x40000000) == 0 or libc.unshare(0x10000000 | 0x40000000) == 0


def _landlock(native, root):
    # Best effort (Linux >= 5.13, works unprivileged): deny writes outside root, exec, TCP and
    # signals to other processes.
    ctypes, libc, RulesetAttr, PathBeneath = native
    abi = libc.syscall(444, None, 0, 1)  # landlock_create_ruleset(VERSION)
    if abi < 1:
        return
    # execute, write, remove dir/file, make char/dir/reg/sock/fifo/block/sym, refer, truncate
    fs = sum(1 << b for b in (0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12))
    fs |= (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)
    attr = RulesetAttr(fs, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)
    ruleset = libc.syscall(444, ctypes.byref(attr), 8 if abi < 4 else 16 if abi < 6 else 24, 0)
    if ruleset < 0:
        return
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


def _lock_down(root, cpu, mem, fsz, cap):
    _limits(cpu, mem, fsz)
    sys.stdout.reconfigure(line_buffering=True)  # what was printed survives a kill
    sys.stdout = _Capped(sys.stdout, cap)
    sys.stderr = _Capped(sys.stderr, -1)
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


def _run_and_exit(src):
    try:
        status, line = _run(src)
    except BaseException as e:  # e.g. an exception whose str() raises
        status, line = 1, type(e).__name__
    try:
        sys.stdout.flush()
    except BaseException:
        pass
    if status:
        os.write(2, ("\n" + " ".join(line.split()) + "\n").encode("utf-8", "replace"))
    os._exit(status)
"""

# spawn mode: argv: tempdir, cpu_s, memory_mb, file_size_mb, max_output_chars; code on stdin.
_SPAWN_MAIN = r"""
_tmp, _cpu, _mem, _fsz, _cap = sys.argv[1], *map(int, sys.argv[2:6])
_src = sys.stdin.read()
sys.stdin.close()
sys.argv = ["<tool>"]
os.environ["TMPDIR"] = _tmp
_root = os.path.realpath(_tmp)
_native = _load_libc()
if _native is not None:
    _unshare_net(_native[1])
    _landlock(_native, _root)
del _native
_lock_down(_root, _cpu, _mem, _fsz, _cap)
_run_and_exit(_src)
"""

# fork mode: the helper. argv: the fd of its end of the socketpair. Frames both ways are a
# 4-byte length and a marshal payload. Request: (id, code, tempdir, cpu_s, memory_mb,
# file_size_mb, max_output_chars, timeout_s). Answer: (id, True, (timed_out, returncode,
# stdout head, stderr tail)) or (id, False, why it could not run).
_SERVER_MAIN = r"""
import gc, marshal, select, time

_NATIVE = [_load_libc()]  # loaded once, before any fork; each child uses it for Landlock
if _NATIVE[0] is not None:
    _unshare_net(_NATIVE[0][1])  # one network namespace without interfaces, for every child
_pidfd_open = getattr(os, "pidfd_open", None)


class _Kid:
    def __init__(self, rid, pid, out, err, pidfd, deadline, keep):
        self.rid, self.pid, self.pidfd, self.deadline, self.keep = rid, pid, pidfd, deadline, keep
        self.out_fd, self.out, self.err = out, bytearray(), bytearray()
        self.bufs = {out: self.out, err: self.err}
        self.open = {out, err}  # pipes not at EOF yet
        self.rc, self.timed_out = None, False


def _send(fd, msg):
    data = marshal.dumps(msg)
    data = memoryview(len(data).to_bytes(4, "big") + data)
    while data:
        data = data[os.write(fd, data):]


def _kill(pid):
    for kill in (os.killpg, os.kill):  # the group; the child itself if it had no group yet
        try:
            kill(pid, 9)
        except OSError:
            pass


def _child(req, out, err, server, forget):
    rid, src, tmp, cpu, mem, fsz, cap, _ = req
    try:
        forget()  # other calls' code and output, in our copy of the helper's memory
        os.setpgid(0, 0)
        native = _NATIVE.pop()
        if native is not None:
            native[1].prctl(1, 9)  # PR_SET_PDEATHSIG: SIGKILL when the helper dies
        if os.getppid() != server:
            os._exit(1)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        os.chdir(tmp)
        os.environ["TMPDIR"] = tmp
        sys.argv = ["<tool>"]
        sys.stdin.close()
        root = os.path.realpath(tmp)
        if native is not None:
            _landlock(native, root)
        del native
        _lock_down(root, cpu, mem, fsz, cap)
    except BaseException as e:
        os.write(2, ("\nsandbox setup failed: " + type(e).__name__ + " " + str(e) + "\n").encode())
        os._exit(1)
    _run_and_exit(src)


def _serve(ctl):
    me = os.getpid()
    poll = select.poll()
    poll.register(ctl, select.POLLIN)
    kids, owner, inbox = {}, {}, bytearray()  # pid -> _Kid, pipe or pidfd -> _Kid

    def forget():
        kids.clear()
        owner.clear()
        inbox.clear()

    def start(req):
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        os.set_blocking(out_r, False)  # our ends only; the child's stay blocking
        os.set_blocking(err_r, False)
        deadline = time.monotonic() + req[7]
        gc.freeze()  # the child's collections skip our objects instead of copying their pages
        try:
            pid = os.fork()
        except OSError as e:
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
            _send(ctl, (req[0], False, "fork failed: " + str(e)))
            return
        if pid == 0:
            try:
                _child(req, out_w, err_w, me, forget)
            finally:
                os._exit(1)
        os.close(out_w)
        os.close(err_w)
        try:
            os.setpgid(pid, pid)  # also here, so a kill right away finds the group
        except OSError:
            pass
        pidfd = None
        if _pidfd_open is not None:
            try:
                pidfd = _pidfd_open(pid)
            except OSError:
                pass
        fds = (out_r, err_r) + ((pidfd,) if pidfd is not None else ())
        try:
            for fd in fds:
                poll.register(fd, select.POLLIN)
        except BaseException:  # never leave a child running that we do not watch
            _kill(pid)
            os.waitpid(pid, 0)
            for fd in fds:
                try:
                    poll.unregister(fd)
                except KeyError:
                    pass
                os.close(fd)
            raise
        kids[pid] = kid = _Kid(req[0], pid, out_r, err_r, pidfd, deadline, 4 * req[6] + 4)
        for fd in fds:
            owner[fd] = kid

    def close(kid, fd):
        poll.unregister(fd)
        os.close(fd)
        del owner[fd]
        kid.open.discard(fd)

    def read(kid, fd):  # True when the pipe has nothing more for now
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return True
        if not chunk:
            close(kid, fd)
            return True
        buf = kid.bufs[fd]
        if fd == kid.out_fd:  # keep reading past the cap so the child never blocks on a full pipe
            buf += chunk[: max(0, kid.keep - len(buf))]
        else:
            buf += chunk
            del buf[:-4096]
        return False

    def sweep(kid, now):
        if kid.rc is None:
            if not kid.timed_out and now >= kid.deadline:
                kid.timed_out = True
                _kill(kid.pid)
            if os.waitid(os.P_PID, kid.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return
            _kill(kid.pid)  # the group, while the unreaped leader still holds its id
            kid.rc = os.waitstatus_to_exitcode(os.waitpid(kid.pid, 0)[1])
            if kid.pidfd is not None:
                close(kid, kid.pidfd)
        if kid.open and not kid.timed_out and now >= kid.deadline:
            kid.timed_out = True  # exited, but something still holds its pipes
        if kid.timed_out:
            for fd in list(kid.open):
                for _ in range(64):  # what is in the pipe now, not what a stray writer adds
                    if read(kid, fd):
                        break
                if fd in kid.open:
                    close(kid, fd)
        if not kid.open:
            del kids[kid.pid]
            result = (kid.timed_out, kid.rc, bytes(kid.out), bytes(kid.err))
            _send(ctl, (kid.rid, True, result))

    _send(ctl, ("ready", me))
    try:
        while True:
            now = time.monotonic()
            wait = 3600.0
            for kid in kids.values():
                if kid.rc is None and kid.pidfd is None:
                    wait = min(wait, 0.01)  # no pidfd to wake us at its exit: look every 10 ms
                if not kid.timed_out:
                    wait = min(wait, kid.deadline - now)
            for fd, _ in poll.poll(max(0.0, wait) * 1000):
                if fd == ctl:
                    chunk = os.read(ctl, 65536)
                    if not chunk:
                        return  # our parent closed its end, or died
                    inbox.extend(chunk)
                    while len(inbox) >= 4 and len(inbox) >= 4 + int.from_bytes(inbox[:4], "big"):
                        size = int.from_bytes(inbox[:4], "big")
                        req = marshal.loads(bytes(inbox[4 : 4 + size]))
                        del inbox[: 4 + size]
                        try:
                            start(req)
                        except Exception as e:  # e.g. out of descriptors: spawn mode will try
                            _send(ctl, (req[0], False, type(e).__name__ + ": " + str(e)))
                elif fd in owner and fd != owner[fd].pidfd:
                    read(owner[fd], fd)
            now = time.monotonic()
            for kid in list(kids.values()):
                sweep(kid, now)
    finally:
        for kid in kids.values():
            _kill(kid.pid)
        for kid in kids.values():
            if kid.rc is None:
                os.waitpid(kid.pid, 0)


try:
    _serve(int(sys.argv[1]))
finally:
    os._exit(0)
"""


def run_python(
    code: str,
    *,
    timeout_s: float = 5.0,
    cpu_s: int = 2,
    memory_mb: int = 512,
    file_size_mb: int = 1,
    max_output_chars: int = 2000,
    mode: Mode = "fork",
) -> SandboxResult:
    """Run ``code`` in a sandboxed child process and return what happened (never raises).

    ``timeout_s`` is wall-clock time from the start of the child (in ``spawn`` mode interpreter
    startup included); ``cpu_s`` its CPU seconds; ``memory_mb`` its address space;
    ``file_size_mb`` the largest file it may write (inside its private directory);
    ``max_output_chars`` how much stdout is kept. ``mode``: ``fork`` (a child forked by this
    process's fork server; falls back to ``spawn`` when the server cannot run it) or ``spawn``
    (a fresh interpreter per call).
    """
    if mode not in ("fork", "spawn"):
        raise ValueError(f"unknown sandbox mode {mode!r}; expected 'fork' or 'spawn'")
    limits = (max(1, int(cpu_s)), int(memory_mb), int(file_size_mb), int(max_output_chars))
    source = code.encode("utf-8", "replace")
    with _slots:
        tmp = tempfile.mkdtemp(prefix="flywheel-sandbox-")
        try:
            raw = None
            if mode == "fork":
                raw = _fork_server.run(source.decode("utf-8"), tmp, limits, timeout_s)
                if raw is None:  # no server, or it died or hung: its child died with it
                    _remove_tree(tmp)
                    tmp = tempfile.mkdtemp(prefix="flywheel-sandbox-")
            if raw is None:
                raw = _spawn(source, tmp, limits, timeout_s)
            return _result(*raw, timeout_s, max_output_chars)
        except Exception as e:  # a failure of ours (spawn, pipes), not of the user code
            return SandboxResult(
                "error", "", _one_line(f"sandbox failure: {type(e).__name__}: {e}")
            )
        finally:
            _remove_tree(tmp)


_Raw = tuple[bool, int, bytes, bytes]  # timed out, return code (-signal), stdout head, stderr tail


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


# -- fork mode ----------------------------------------------------------------------------------


class _Call:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.answer: tuple[Any, ...] | None = None  # None: the server died before answering


class _Server:
    """One running fork server: its process, our end of its socket, the calls it owes."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.proc, self.sock, self.pid = proc, sock, proc.pid
        self.alive = True
        self._lock = threading.Lock()  # pending calls; held briefly, never while sending
        self._send_lock = threading.Lock()  # whole frames, one at a time
        self._pending: dict[int, _Call] = {}
        self._ids = itertools.count()
        threading.Thread(target=self._read, name="sandbox-fork-server", daemon=True).start()

    def call(self, request: tuple[Any, ...], wait_s: float | None) -> _Raw | None:
        call = _Call()
        with self._lock:
            if not self.alive:
                return None
            rid = next(self._ids)
            self._pending[rid] = call
        try:
            with self._send_lock:
                _send_frame(self.sock, (rid, *request))
        except OSError:
            self.kill()
        if not call.done.wait(wait_s):
            self.kill()  # hung: its children die with it (PR_SET_PDEATHSIG)
            call.done.wait(_SERVER_GRACE_S)
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
        """Ask the server to exit (it kills its children), and kill it if it does not."""
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
                answer = _recv_frame(self.sock)
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


class _ForkServer:
    """This process's fork server: started on first use, restarted after it dies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._server: _Server | None = None
        self._retry_at = 0.0
        self.start_error = ""  # why the last start failed, for logs and tests

    def run(self, code: str, tmp: str, limits: tuple[int, ...], timeout_s: float) -> _Raw | None:
        server = self._get()
        if server is None:
            return None
        timeout_s = float(timeout_s)
        wait_s = timeout_s + _SERVER_GRACE_S if math.isfinite(timeout_s) else None
        return server.call((code, tmp, *limits, min(timeout_s, 1e9)), wait_s)

    def pid(self) -> int | None:
        """The running server's process id, starting it if needed (None if it cannot start)."""
        server = self._get()
        return None if server is None else server.pid

    def _get(self) -> _Server | None:
        with self._lock:
            if self._server is not None and self._server.alive:
                return self._server
            if time.monotonic() < self._retry_at:
                return None
            try:
                self._server = _start_server()
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


def _start_server() -> _Server:
    ours, theirs = socket.socketpair()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", "-c", _CHILD + _SERVER_MAIN, str(theirs.fileno())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(theirs.fileno(),),
            cwd="/",
            env=_ENV,
            start_new_session=True,  # Ctrl-C in our terminal is ours to handle, not its
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    try:
        ours.settimeout(_SERVER_START_S)
        hello = _recv_frame(ours)
        if hello != ("ready", proc.pid):
            raise RuntimeError(f"unexpected greeting {hello!r}")
        ours.settimeout(None)
    except BaseException:
        ours.close()
        proc.kill()
        proc.wait()
        raise
    return _Server(proc, ours)


def _send_frame(sock: socket.socket, msg: tuple[Any, ...]) -> None:
    data = marshal.dumps(msg)
    sock.sendall(len(data).to_bytes(4, "big") + data)


def _recv_frame(sock: socket.socket) -> tuple[Any, ...]:
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


_fork_server = _ForkServer()
atexit.register(_fork_server.stop)


def _after_fork_in_child() -> None:
    global _slots
    _slots = threading.BoundedSemaphore(MAX_CONCURRENT)  # slots held by threads not copied
    _fork_server.forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


# -- spawn mode ---------------------------------------------------------------------------------


def _spawn(source: bytes, tmp: str, limits: tuple[int, ...], timeout_s: float) -> _Raw:
    argv = [sys.executable, "-I", "-S", "-B", "-c", _CHILD + _SPAWN_MAIN, tmp, *map(str, limits)]
    env = {**_ENV, "TMPDIR": tmp}
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
        feeder = threading.Thread(target=_feed, args=(proc.stdin, source), daemon=True)
        feeder.start()
        stdout, stderr, timed_out = _collect(proc, deadline, 4 * limits[3] + 4)
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
