"""Hostile code against the sandbox: every escape reported in issue 10 and its relatives.

Each case runs code written to escape and then checks, from outside, that the escape's effect
did not happen: no process left over, no file written outside, no secret in the output, no
change to our priority, no connection accepted. Fork mode (the default) throughout; the
fork-server tests in tests/flywheel/envs/test_sandbox.py run the basics in both modes.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flywheel.envs.sandbox import SandboxResult, run_python, runner

NOBODY = 65534
SUBINTERP = "import _xxsubinterpreters as _si\n_si.run_string(_si.create(), {inner!r})\n"
LIBC = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"


def in_subinterpreter(inner: str) -> str:
    """Code that runs ``inner`` in a sub-interpreter (no audit hooks, its own modules)."""
    return SUBINTERP.format(inner=inner)


def _sandboxed_processes(server: int) -> list[int]:
    """Live processes of the sandbox user in our fork server's network namespace.

    Every call inherits that namespace and no call can leave it (no CAP_SYS_ADMIN, no setns),
    so an escaped process would still be found here; other fork servers on the machine (other
    test runs) have namespaces of their own.
    """
    netns = os.readlink(f"/proc/{server}/ns/net")
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            same_net = os.readlink(entry / "ns" / "net") == netns
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        uid = int(fields["Uid"].split()[0])
        if same_net and uid == NOBODY and fields["State"].split()[0] != "Z":
            found.append(int(entry.name))
    return found


@pytest.fixture(autouse=True)
def nothing_outlives_a_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """After every case: no process of the sandbox user, no private directory left."""
    server = runner._fork_server.pid()
    assert server is not None, runner._fork_server.start_error
    private_dirs = tmp_path / "private"
    private_dirs.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private_dirs))  # where run_python makes them
    yield
    assert _sandboxed_processes(server) == [], "a sandboxed process outlived its call"
    assert list(private_dirs.iterdir()) == [], "a private directory outlived its call"


@pytest.fixture
def outside() -> Iterator[Path]:
    """A world-writable directory outside the sandbox, as /tmp or /var/tmp are."""
    path = Path(tempfile.mkdtemp(prefix="hostile-", dir="/var/tmp"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path)


def ran(code: str, **limits: object) -> SandboxResult:
    return run_python(code, timeout_s=limits.pop("timeout_s", 5.0), **limits)  # type: ignore[arg-type]


# -- leftover processes: forks, sub-interpreters, sessions ---------------------------------------

DETACH = (
    "import ctypes, time\nlibc = ctypes.CDLL(None)\npid = libc.fork()\n"
    "if pid == 0:\n    libc.setsid()\n    time.sleep(30)\nprint('fork returned', pid)\n"
)


@pytest.mark.parametrize(
    "code",
    [
        DETACH,
        in_subinterpreter(DETACH),
        "import os\nfor _ in range(100):\n    os.fork()",
        "import os\nif os.fork() == 0:\n    os.setsid()\n    import time\n    time.sleep(30)",
        "import subprocess\nsubprocess.Popen(['sleep', '30'], start_new_session=True)",
        "import multiprocessing\nmultiprocessing.Process(target=print).start()",
        "import threading, time\nthreading.Thread(target=time.sleep, args=(30,)).start()",
        in_subinterpreter(
            "import threading, time\nthreading.Thread(target=time.sleep, args=(30,)).start()"
        ),
        LIBC + "print(libc.syscall(56, 0x11, 0, 0, 0, 0))  # raw clone(SIGCHLD)",
        LIBC + "print(libc.syscall(435, 0, 0))  # clone3",
        "import os\nos.execv('/bin/sh', ['sh', '-c', 'sleep 30 &'])",
    ],
    ids=[
        "ctypes-fork-setsid",
        "subinterp-fork-setsid",
        "fork-bomb",
        "os-fork-setsid",
        "popen-new-session",
        "multiprocessing",
        "thread",
        "subinterp-thread",
        "raw-clone",
        "clone3",
        "exec-shell",
    ],
)
def test_no_process_outlives_the_call(code: str) -> None:
    result = ran(code)
    assert "fork returned 0" not in result.output
    if result.output:
        assert result.output.strip().endswith("-1")  # libc's fork or syscall failed
    else:
        assert result.status == "error"


def test_sleeping_code_is_killed_with_everything_at_the_timeout() -> None:
    start = time.monotonic()
    result = ran(in_subinterpreter(DETACH) + "import time\ntime.sleep(60)", timeout_s=1.0)
    assert result.status == "timeout"
    assert time.monotonic() - start < 3.0


def test_only_the_calls_own_processes_are_visible() -> None:
    code = "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
    assert ran(code).output == "[1, 2]\n"  # the call's init and the code's process
    assert ran(in_subinterpreter(code)).output == "[1, 2]\n"


# -- secrets: other processes' environments, files ----------------------------------------------

_SECRET_PROBE = r"""
import json, os, sys
from flywheel.envs.sandbox import run_python
probes = {
    "own-env": "import os\nprint(dict(os.environ))",
    "proc-environ": "import os\nfor p in os.listdir('/proc'):\n    try:\n        print(open(f'/proc/{p}/environ').read())\n    except Exception as e:\n        print(type(e).__name__)",
    "ancestor-by-number": "\n".join(f"try:\n    print(open('/proc/{pid}/environ').read())\nexcept Exception as e:\n    print(type(e).__name__)" for pid in (os.getpid(), os.getppid())),
    "init-root": "import os\nprint(os.listdir('/proc/1/root'))",
    "subinterp-ctypes": "import _xxsubinterpreters as s\ns.run_string(s.create(), " + repr("import ctypes\nfor pid in %r:\n    buf = ctypes.create_string_buffer(65536)\n    libc = ctypes.CDLL(None)\n    fd = libc.open(f'/proc/{pid}/environ'.encode(), 0)\n    n = libc.read(fd, buf, 65536) if fd >= 0 else -1\n    print(buf.raw[:max(n, 0)])" % ((1, os.getpid(), os.getppid()),)) + ")",
}
print(json.dumps({name: run_python(code).__dict__ for name, code in probes.items()}))
"""


def test_no_ancestors_environment_is_readable() -> None:
    secret = "hub-token-" + os.urandom(8).hex()
    env = {**os.environ, "HF_TOKEN": secret, "AWS_SECRET_ACCESS_KEY": secret}
    out = subprocess.run(
        [sys.executable, "-c", _SECRET_PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)
    assert len(results) == 5
    for name, result in results.items():
        assert secret not in json.dumps(result), name
    assert "PermissionError" in results["proc-environ"]["output"]  # the init's, root's
    assert results["ancestor-by-number"]["output"].count("FileNotFoundError") == 2
    assert results["init-root"]["status"] == "error"


@pytest.fixture
def secret_file() -> Iterator[Path]:
    """A world-readable file in a world-readable directory outside the sandbox."""
    folder = Path(tempfile.mkdtemp(prefix="hostile-", dir="/var/tmp"))
    folder.chmod(0o755)
    path = folder / "credentials"
    path.write_text("s3cr3t-" + os.urandom(8).hex())
    path.chmod(0o644)
    yield path
    shutil.rmtree(folder)


@pytest.mark.parametrize(
    "template",
    [
        "print(open({path!r}).read())",
        "import os\nprint(os.listdir(os.path.dirname({path!r})))",
        LIBC + "buf = ctypes.create_string_buffer(99)\n"
        "fd = libc.open({path!r}.encode(), 0)\nassert fd >= 0\nlibc.read(fd, buf, 99)\nprint(buf.value)",
        in_subinterpreter("print(open('PATH').read())"),
        "import os\nos.symlink({path!r}, 'link')\nprint(open('link').read())",
    ],
    ids=["open", "listdir", "ctypes-open", "subinterp-open", "symlink"],
)
def test_files_outside_the_allowed_directories_are_unreadable(
    template: str, secret_file: Path
) -> None:
    code = template.replace("PATH", str(secret_file)).format(path=str(secret_file))
    result = ran(code)
    assert result.status == "error"
    assert secret_file.read_text() not in result.output
    assert "credentials" not in result.output


@pytest.mark.parametrize(
    "path", ["/etc/shadow", "/root/.bash_history", "/root/.ssh", "/work", "/sys/kernel"]
)
def test_system_secrets_and_the_project_are_unreadable(path: str) -> None:
    result = ran(
        f"import os\np = {path!r}\nprint(os.listdir(p) if os.path.isdir(p) else open(p).read())"
    )
    assert result.status == "error"
    assert result.output == ""


# -- writing outside, disk use --------------------------------------------------------------------


@pytest.mark.parametrize(
    "template",
    [
        "open({target!r}, 'w').write('x')",
        in_subinterpreter("open('TARGET', 'w').write('x')"),
        LIBC + "fd = libc.open({target!r}.encode(), 0o101, 0o644)\nassert fd >= 0",
        "import os\nos.mkfifo({target!r})",
        "import os\nopen('a', 'w').write('x')\nos.rename('a', {target!r})",
        "import os\nos.link('/usr/bin/env', {target!r})",
        "import os\nos.symlink({target!r}, 'link')\nopen('link', 'w').write('x')",
        "open('/dev/shm/hostile-' + {name!r}, 'w').write('x')",
    ],
    ids=["open", "subinterp", "ctypes", "mkfifo", "rename", "hardlink", "symlink", "dev-shm"],
)
def test_nothing_is_written_outside(template: str, outside: Path) -> None:
    target = outside / "evil"
    code = template.replace("TARGET", str(target)).format(target=str(target), name=outside.name)
    result = ran(code)
    assert result.status == "error"
    assert list(outside.iterdir()) == []
    assert not Path(f"/dev/shm/hostile-{outside.name}").exists()


def test_the_private_directory_cannot_be_made_undeletable() -> None:
    # chattr +i: FS_IOC_SETFLAGS with FS_IMMUTABLE_FL (needs CAP_LINUX_IMMUTABLE)
    code = (
        "import fcntl, os, struct\nopen('f', 'w').write('x')\n"
        "fd = os.open('.', os.O_RDONLY)\nfcntl.ioctl(fd, 0x40086602, struct.pack('l', 0x10))"
    )
    result = ran(code)
    assert result.status == "error"  # the fixture checks that the directory is gone


def test_total_disk_use_is_bounded() -> None:
    # 1 MB files, each under the per-file limit, until the disk budget says no
    code = (
        "n = 0\ntry:\n    while n < 1000:\n        open(f'f{n}', 'wb').write(b'x' * (1 << 20))\n"
        "        n += 1\nfinally:\n    print(n)"
    )
    free = shutil.disk_usage("/").free
    start = time.monotonic()
    result = ran(code, file_size_mb=2, disk_mb=8)
    assert result.status == "error"
    assert "No space left" in result.error
    assert int(result.output) <= 8
    assert time.monotonic() - start < 2.0
    assert shutil.disk_usage("/").free > free - (64 << 20)  # nothing reached the real disk


def test_the_number_of_files_is_bounded() -> None:
    code = "n = 0\ntry:\n    while n < 100000:\n        open(f'{n}', 'w').close()\n        n += 1\nfinally:\n    print(n)"
    result = ran(code)
    assert result.status == "error"
    assert int(result.output) < 5000


def test_memory_bombs_hit_the_address_space_limit() -> None:
    assert ran("x = bytearray(2**31)", memory_mb=256).error == "memory limit exceeded"
    result = ran("x = []\nwhile True:\n    x.append(bytearray(1 << 20))", memory_mb=256)
    assert result.error == "memory limit exceeded"


# -- CPU, signals, priority, limits ---------------------------------------------------------------


def test_ignoring_sigxcpu_does_not_escape_the_cpu_limit() -> None:
    code = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass"
    start = time.monotonic()
    result = ran(code, cpu_s=1, timeout_s=10.0)
    assert result.status == "killed"
    assert time.monotonic() - start < 4.0


def test_our_priority_cannot_be_changed() -> None:
    server = runner._fork_server.pid()
    assert server is not None
    ours = (os.getpriority(os.PRIO_PROCESS, 0), os.getpriority(os.PRIO_PROCESS, server))
    for code in (
        f"import os\nos.setpriority(os.PRIO_PROCESS, {os.getpid()}, 19)",
        f"import os\nos.setpriority(os.PRIO_PROCESS, {server}, 19)",
        "import os\nos.setpriority(os.PRIO_PROCESS, os.getppid(), 19)",
        "import os\nos.setpriority(os.PRIO_USER, 0, 19)",
        "import os\nos.setpriority(os.PRIO_PGRP, 0, 19)",
        LIBC + f"assert libc.setpriority(0, {os.getpid()}, 19) == 0",
    ):
        assert ran(code).status == "error", code
    assert (os.getpriority(os.PRIO_PROCESS, 0), os.getpriority(os.PRIO_PROCESS, server)) == ours


def test_no_signal_reaches_a_process_outside() -> None:
    server = runner._fork_server.pid()
    assert server is not None
    for code in (
        f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)",
        f"import os, signal\nos.kill({server}, signal.SIGKILL)",
        "import os, signal\nos.kill(1, signal.SIGKILL)\nos.kill(os.getppid(), signal.SIGTERM)",
        "import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('alive')",
        LIBC + f"assert libc.kill({server}, 9) == 0",
    ):
        ran(code)
    assert runner._fork_server.pid() == server
    assert ran("print('still serving')").output == "still serving\n"


def test_limits_cannot_be_raised_nor_privileges_regained() -> None:
    for code in (
        "import resource\nresource.setrlimit(resource.RLIMIT_NPROC, (100, 100))",
        "import resource\nresource.prlimit(1, resource.RLIMIT_CPU, (1, 1))",
        "import os\nos.setuid(0)",
        LIBC + "assert libc.unshare(0x10000000) == 0  # a user namespace: capabilities back",
        LIBC + "assert libc.syscall(161, b'/') == 0  # chroot",
        LIBC + "assert libc.mount(b'none', b'.', b'tmpfs', 0, None) == 0",
        LIBC + "assert libc.syscall(101, 16, 1, 0, 0) == 0  # ptrace attach to the init",
        LIBC + "assert libc.syscall(321, 0, 0, 0) >= 0  # bpf",
        LIBC + "assert libc.syscall(425, 8, ctypes.create_string_buffer(120)) >= 0  # io_uring",
        LIBC + "assert libc.syscall(250, 0, -3, 0) >= 0  # keyctl: the session keyring",
        LIBC
        + "assert libc.syscall(29, 0, 1 << 20, 0o1000 | 0o600) >= 0  # SysV shm would outlive us",
    ):
        assert ran(code).status == "error", code


def test_a_foreign_syscall_convention_kills_the_process() -> None:
    # x32 numbers (bit 30) would bypass an x86_64 deny list: the filter kills instead
    if os.uname().machine != "x86_64":
        pytest.skip("x86_64 only")
    result = ran(LIBC + "libc.syscall(0x40000000 | 41, 2, 1, 0)\nprint('survived')")
    assert result == SandboxResult("killed", "", "killed by the seccomp filter", False)


# -- network ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code",
    [
        "import socket\nsocket.create_connection(('127.0.0.1', PORT), timeout=1)",
        in_subinterpreter(
            "import socket\nsocket.create_connection(('127.0.0.1', PORT), timeout=1)"
        ),
        LIBC + "print(libc.socket(2, 1, 0))\nassert libc.socket(2, 1, 0) >= 0",
        "import socket\nsocket.getaddrinfo('pypi.org', 443)",
        "import socket\nsocket.socket(socket.AF_UNIX).connect('SOCK')",
        in_subinterpreter("import socket\nsocket.socket(socket.AF_UNIX).connect('SOCK')"),
        "import socket\nsocket.socketpair()",
        "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\ns.sendto(b'x', ('8.8.8.8', 53))",
    ],
    ids=[
        "tcp",
        "subinterp-tcp",
        "ctypes-socket",
        "dns",
        "host-unix-socket",
        "subinterp-unix",
        "socketpair",
        "udp-dns",
    ],
)
def test_no_network_and_no_host_socket(code: str, outside: Path) -> None:
    sock_path = outside / "sock"
    with (
        socket.socket(socket.AF_INET) as tcp,
        socket.socket(socket.AF_UNIX) as unix,
    ):
        tcp.bind(("127.0.0.1", 0))
        tcp.listen(1)
        unix.bind(str(sock_path))
        sock_path.chmod(0o777)
        unix.listen(1)
        for server in (tcp, unix):
            server.settimeout(0.2)
        code = code.replace("PORT", str(tcp.getsockname()[1])).replace("SOCK", str(sock_path))
        result = ran(code)
        assert result.status == "error"
        for server in (tcp, unix):
            with pytest.raises(TimeoutError):
                server.accept()


# -- inherited descriptors --------------------------------------------------------------------------


def test_no_descriptor_is_inherited() -> None:
    code = (
        "import os\nopen_fds = []\nfor fd in range(3, 1024):\n    try:\n        os.fstat(fd)\n"
        "        open_fds.append(fd)\n    except OSError:\n        pass\nprint(open_fds)"
    )
    assert ran(code).output == "[]\n"
    assert ran(in_subinterpreter(code)).output == "[]\n"


def test_stdin_is_empty() -> None:
    assert ran("import sys\nprint(repr(sys.stdin.read()))").output == "''\n"
