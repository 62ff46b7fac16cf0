"""The sandbox runs agent code and contains it: limits, no processes, no network, no stray writes.

The hostile cases (escapes tried on purpose) are in tests/reliability/test_sandbox_hostile.py.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from flywheel.envs.sandbox import SandboxResult, client, run_python, runner

Run = Callable[..., SandboxResult]


@pytest.fixture(params=["fork", "spawn"])
def run(request: pytest.FixtureRequest) -> Run:
    """``run_python`` in one mode: every containment test runs in both."""
    return functools.partial(run_python, mode=request.param)


def test_print_is_captured(run: Run) -> None:
    result = run("x = 37 + 12\nprint(x)")
    assert result == SandboxResult("ok", "49\n", "", False)


def test_exception_gives_one_error_line(run: Run) -> None:
    result = run("print('before')\n1 / 0")
    assert result.status == "error"
    assert result.error == "ZeroDivisionError: division by zero"
    assert result.output == "before\n"


def test_syntax_error_is_an_error(run: Run) -> None:
    result = run("print(")
    assert result.status == "error"
    assert result.error.startswith("SyntaxError:")


def test_busy_loop_is_stopped_by_the_cpu_limit(run: Run) -> None:
    start = time.monotonic()
    result = run("while True:\n    pass", timeout_s=5.0, cpu_s=1)
    assert result.status in ("killed", "timeout")
    assert time.monotonic() - start < 4.0


def test_sleep_is_stopped_by_the_wall_clock(run: Run) -> None:
    start = time.monotonic()
    result = run("import time\nprint('hi')\ntime.sleep(60)", timeout_s=1.0)
    assert result.status == "timeout"
    assert result.error == "timeout after 1.0 s"
    assert result.output == "hi\n"  # what was printed before the kill is kept
    assert time.monotonic() - start < 3.0


def test_memory_hog_is_contained(run: Run) -> None:
    result = run("x = bytearray(2**31)\nprint('allocated')", memory_mb=256)
    assert result.status in ("error", "killed")
    assert "allocated" not in result.output
    assert "memory" in result.error


def test_fork_is_blocked(run: Run) -> None:
    result = run("import os\nos.fork()\nprint('forked')")
    assert result.status == "error"
    assert result.error == "PermissionError: [Errno 1] Operation not permitted"
    assert "forked" not in result.output


@pytest.mark.parametrize(
    "launch",
    [
        "import subprocess\nsubprocess.run(['touch', {marker!r}])",
        "import os\nassert os.system('touch {marker}') == 0",
        "import os\nos.posix_spawn('/usr/bin/touch', ['touch', {marker!r}], {{}})",
        "import os\nos.execv('/usr/bin/touch', ['touch', {marker!r}])",
        "import ctypes\nassert ctypes.CDLL(None).system(b'touch {marker}') == 0",
    ],
)
def test_processes_cannot_be_started(run: Run, launch: str, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    result = run(launch.format(marker=str(marker)))
    assert result.status == "error"
    assert not marker.exists()


def test_no_connection_reaches_a_local_server(run: Run) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.3)
        port = server.getsockname()[1]
        code = f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\ns.sendall(b'hi')"
        result = run(code)
        assert result.status == "error"
        assert "Operation not permitted" in result.error
        with pytest.raises(TimeoutError):
            server.accept()


def test_writes_outside_the_private_directory_are_blocked(run: Run, tmp_path: Path) -> None:
    target = tmp_path / "evil.txt"
    keep = tmp_path / "keep.txt"
    keep.write_text("precious")
    attempts = [
        f"open({str(target)!r}, 'w').write('x')",
        f"import os\nfd = os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
        f"import os\nos.remove({str(keep)!r})",
        f"import os\nopen('a', 'w').close()\nos.rename('a', {str(target)!r})",
        f"import os\nos.chdir({str(tmp_path)!r})\nopen('evil.txt', 'w').write('x')",
        # patching os.path must not fool the check
        f"import os\nos.path.realpath = lambda p: os.getcwd() + '/ok'\nopen({str(target)!r}, 'w')",
    ]
    for code in attempts:
        result = run(code)
        assert result.status == "error", code
        assert "Error" in result.error, (code, result.error)
    assert not target.exists()
    assert keep.read_text() == "precious"


def test_writes_inside_the_private_directory_work(run: Run) -> None:
    code = "open('notes.txt', 'w').write('12')\nprint(int(open('notes.txt').read()) * 2)"
    assert run(code) == SandboxResult("ok", "24\n", "", False)


def test_large_files_hit_the_file_size_limit(run: Run) -> None:
    result = run("open('big', 'wb').write(b'x' * (3 << 20))", file_size_mb=1)
    assert result.status in ("error", "killed")
    assert "File too large" in result.error or "file size" in result.error


def test_huge_output_is_truncated(run: Run) -> None:
    result = run("print('x' * 10**6)\nprint('done')", max_output_chars=100)
    assert result.status == "ok"
    assert result.output == "x" * 100
    assert result.truncated


def test_private_directory_is_removed_afterwards(run: Run) -> None:
    result = run("import os\nopen('f.txt', 'w').write('x')\nprint(os.getcwd())")
    cwd = result.output.strip()
    assert result.status == "ok"
    assert "flywheel-sandbox-" in cwd
    assert not os.path.exists(cwd)


def test_environment_and_limits_are_not_inherited(
    run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLYWHEEL_TEST_SECRET", "s3cret")
    assert run("import os\nprint(os.environ.get('FLYWHEEL_TEST_SECRET'))").output == "None\n"
    raise_limit = "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))"
    assert "not allowed to raise" in run(raise_limit).error
    # its parent is the call's init (pid 1 of the call's namespace), which runs as root
    assert "Operation not permitted" in run("import os\nos.kill(os.getppid(), 0)").error


def test_concurrent_calls_do_not_mix(run: Run) -> None:
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda i: run(f"print({i} * 7)"), range(8)))
    assert [r.output for r in results] == [f"{i * 7}\n" for i in range(8)]


def test_the_child_holds_no_descriptor_but_its_stdio(run: Run) -> None:
    # in fork mode, the fork server's socket and the other calls' pipes must be closed
    result = run("import os\nprint(sorted(os.listdir('/proc/self/fd')))")
    assert result.output == "['0', '1', '2', '3']\n"  # 3: the directory being listed


def test_kernel_layers_are_in_place(run: Run) -> None:
    code = (
        "import os\nprint(*(os.readlink(f'/proc/self/ns/{ns}') for ns in ('net', 'pid', 'mnt')))\n"
        "print(open('/proc/self/status').read())"
    )
    namespaces, status = run(code).output.split("\n", 1)
    ours = [os.readlink(f"/proc/self/ns/{ns}") for ns in ("net", "pid", "mnt")]
    assert all(a != b for a, b in zip(namespaces.split(), ours, strict=True))
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert fields["NoNewPrivs"] == "1"
    assert fields["Seccomp"] == "2"  # a filter
    for capability_set in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(fields[capability_set], 16) == 0, capability_set
    if os.geteuid() == 0:
        assert fields["Uid"].split() == ["65534"] * 4
        assert fields["Gid"].split() == ["65534"] * 4
    assert fields["Pid"] == "2"  # pid 1 is the call's init


# -- the fork server ------------------------------------------------------------------------------


def _server_pid() -> int:
    pid = runner._fork_server.pid()
    assert pid is not None, runner._fork_server.start_error
    return pid


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (nobody may reap an orphan here)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if fields[1] == str(pid) and fields[0] != "Z":
                kids.append(int(entry.name))
    return kids


def _lasting_child(pid: int, timeout_s: float = 10.0) -> int:
    """A child of ``pid`` seen twice, 0.2 s apart: the one a list read at a single moment could
    lose (a CI run saw the list empty right after it was not)."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = set(_children(pid))
        time.sleep(0.2)
        lasting = seen & set(_children(pid))
        if lasting:
            return min(lasting)
        assert time.monotonic() < deadline, f"timed out waiting for a lasting child of {pid}"


def _wait_until(condition: Callable[[], object], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


@pytest.mark.parametrize(
    "code, status, error",
    [
        ("import faulthandler\nfaulthandler._sigsegv()", "killed", "killed by SIGSEGV"),
        ("import os\nos.abort()", "killed", "killed by SIGABRT"),
        ("x = bytearray(2**31)", "error", "memory limit exceeded"),
        ("import os\nos._exit(7)", "error", "exit code 7"),
    ],
)
def test_the_server_survives_a_crashing_child(code: str, status: str, error: str) -> None:
    server = _server_pid()
    result = run_python(code, memory_mb=256)
    assert (result.status, result.error) == (status, error)
    assert run_python("print('next')").output == "next\n"
    assert _server_pid() == server


def test_the_server_survives_a_child_killed_from_outside() -> None:
    server = _server_pid()
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(run_python, "import time\ntime.sleep(30)", timeout_s=30.0)
        _wait_until(lambda: _children(server))
        os.kill(_children(server)[0], signal.SIGKILL)
        result = future.result(timeout=10)
    assert result.status == "killed"
    assert run_python("print('next')").output == "next\n"
    assert _server_pid() == server


def test_a_dead_server_is_replaced() -> None:
    old = _server_pid()
    os.kill(old, signal.SIGKILL)
    assert run_python("print('next')").output == "next\n"
    _wait_until(lambda: not _running(old))
    new = _server_pid()
    assert new != old
    assert run_python("print('again')").output == "again\n"
    assert _server_pid() == new


def test_a_call_whose_server_dies_is_rerun_in_spawn_mode() -> None:
    server = _server_pid()
    code = "import time\ntime.sleep(3)\nprint('done')"
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(run_python, code, timeout_s=10.0)
        _wait_until(lambda: _children(server))
        child = _children(server)[0]
        os.kill(server, signal.SIGKILL)
        _wait_until(lambda: not _running(child), timeout_s=2.0)  # died with its server
        result = future.result(timeout=20)
    assert result == SandboxResult("ok", "done\n", "", False)


def test_a_hung_server_is_killed_and_the_call_rerun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client, "SERVER_GRACE_S", 0.5)
    server = _server_pid()
    os.kill(server, signal.SIGSTOP)
    try:
        start = time.monotonic()
        result = run_python("print('fine')", timeout_s=0.5)
        assert result == SandboxResult("ok", "fine\n", "", False)
        assert time.monotonic() - start < 5.0
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed and reaped, as it should be
            os.kill(server, signal.SIGCONT)
    _wait_until(lambda: not _running(server))
    assert _server_pid() != server


def test_a_forked_process_starts_its_own_server() -> None:
    server = _server_pid()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            result = run_python("print(6 * 7)")
            os.write(write_end, f"{result.output.strip()} {runner._fork_server.pid()}".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        output, child_server = pipe.read().split()
    os.waitpid(pid, 0)
    assert output == "42"
    assert int(child_server) != server
    _wait_until(lambda: not _running(int(child_server)))  # gone with the forked process
    assert run_python("print('still here')").output == "still here\n"
    assert _server_pid() == server


def test_spawn_mode_is_used_when_the_server_cannot_start(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = client.ForkServer()
    monkeypatch.setattr(runner, "_fork_server", broken)

    def cannot_start() -> client.Server:
        raise RuntimeError("cannot isolate the sandbox")

    monkeypatch.setattr(client, "start_server", cannot_start)
    assert run_python("print(6 * 7)") == SandboxResult("ok", "42\n", "", False)
    assert broken.start_error
    assert broken.pid() is None  # not retried at every call


def test_eight_threads_get_their_own_output() -> None:
    def call(i: int) -> SandboxResult:
        code = (
            f"import time\ntime.sleep({i % 4} * 0.01)\nprint({i} * 7)\n"
            f"open('mine', 'w').write('{i}')\nprint(open('mine').read())"
        )
        return run_python(code)

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(call, range(48)))
    assert [r.output for r in results] == [f"{i * 7}\n{i}\n" for i in range(48)]
    assert all(r.status == "ok" for r in results)


_PARENT = """
import sys, threading
from flywheel.envs.sandbox import run_python, runner
assert run_python("print(1)").output == "1\\n"
print(runner._fork_server.pid(), flush=True)
if sys.argv[1] == "killed":
    threading.Thread(target=run_python, args=("import time; time.sleep(60)",),
                     kwargs={"timeout_s": 60.0}, daemon=True).start()
sys.stdin.readline()  # exit when the test closes our stdin
"""


@pytest.mark.parametrize("how", ["exits", "killed"])
def test_the_server_is_gone_after_its_parent(how: str, tmp_path: Path) -> None:
    # a killed parent cannot remove its calls' directories: keep them out of /tmp
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, how],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert parent.stdin is not None and parent.stdout is not None
        server = int(parent.stdout.readline())
        assert _running(server)
        if how == "killed":
            child = _lasting_child(server)
            parent.kill()  # no atexit: the server must notice on its own
        else:
            parent.stdin.close()  # a normal exit
        parent.wait(timeout=30)
    finally:
        parent.kill()
        parent.wait()
    _wait_until(lambda: not _running(server), timeout_s=5.0)
    if how == "killed":
        _wait_until(lambda: not _running(child), timeout_s=5.0)
