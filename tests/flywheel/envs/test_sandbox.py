"""The sandbox runs agent code and contains it: limits, no processes, no network, no stray writes."""

from __future__ import annotations

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from flywheel.envs.sandbox import SandboxResult, run_python


def test_print_is_captured() -> None:
    result = run_python("x = 37 + 12\nprint(x)")
    assert result == SandboxResult("ok", "49\n", "", False)


def test_exception_gives_one_error_line() -> None:
    result = run_python("print('before')\n1 / 0")
    assert result.status == "error"
    assert result.error == "ZeroDivisionError: division by zero"
    assert result.output == "before\n"


def test_syntax_error_is_an_error() -> None:
    result = run_python("print(")
    assert result.status == "error"
    assert result.error.startswith("SyntaxError:")


def test_busy_loop_is_stopped_by_the_cpu_limit() -> None:
    start = time.monotonic()
    result = run_python("while True:\n    pass", timeout_s=5.0, cpu_s=1)
    assert result.status in ("killed", "timeout")
    assert time.monotonic() - start < 4.0


def test_sleep_is_stopped_by_the_wall_clock() -> None:
    start = time.monotonic()
    result = run_python("import time\nprint('hi')\ntime.sleep(60)", timeout_s=1.0)
    assert result.status == "timeout"
    assert result.error == "timeout after 1.0 s"
    assert result.output == "hi\n"  # what was printed before the kill is kept
    assert time.monotonic() - start < 3.0


def test_memory_hog_is_contained() -> None:
    result = run_python("x = bytearray(2**31)\nprint('allocated')", memory_mb=256)
    assert result.status in ("error", "killed")
    assert "allocated" not in result.output
    assert "memory" in result.error


def test_fork_is_blocked() -> None:
    result = run_python("import os\nos.fork()\nprint('forked')")
    assert result.status == "error"
    assert "os.fork is not allowed" in result.error
    assert "forked" not in result.output


@pytest.mark.parametrize(
    "launch",
    [
        "import subprocess\nsubprocess.run(['touch', {marker!r}])",
        "import os\nos.system('touch {marker}')",
        "import os\nos.posix_spawn('/usr/bin/touch', ['touch', {marker!r}], {{}})",
        "import os\nos.execv('/usr/bin/touch', ['touch', {marker!r}])",
    ],
)
def test_processes_cannot_be_started(launch: str, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    result = run_python(launch.format(marker=str(marker)))
    assert result.status == "error"
    assert "not allowed" in result.error
    assert not marker.exists()


def test_no_connection_reaches_a_local_server() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.3)
        port = server.getsockname()[1]
        code = f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\ns.sendall(b'hi')"
        result = run_python(code)
        assert result.status == "error"
        assert "not allowed" in result.error
        with pytest.raises(TimeoutError):
            server.accept()


def test_writes_outside_the_private_directory_are_blocked(tmp_path: Path) -> None:
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
        result = run_python(code)
        assert result.status == "error", code
        assert "not allowed" in result.error, (code, result.error)
    assert not target.exists()
    assert keep.read_text() == "precious"


def test_writes_inside_the_private_directory_work() -> None:
    code = "open('notes.txt', 'w').write('12')\nprint(int(open('notes.txt').read()) * 2)"
    assert run_python(code) == SandboxResult("ok", "24\n", "", False)


def test_large_files_hit_the_file_size_limit() -> None:
    result = run_python("open('big', 'wb').write(b'x' * (3 << 20))", file_size_mb=1)
    assert result.status in ("error", "killed")
    assert "File too large" in result.error or "file size" in result.error


def test_huge_output_is_truncated() -> None:
    result = run_python("print('x' * 10**6)\nprint('done')", max_output_chars=100)
    assert result.status == "ok"
    assert result.output == "x" * 100
    assert result.truncated


def test_private_directory_is_removed_afterwards() -> None:
    result = run_python("import os\nopen('f.txt', 'w').write('x')\nprint(os.getcwd())")
    cwd = result.output.strip()
    assert result.status == "ok"
    assert "flywheel-sandbox-" in cwd
    assert not os.path.exists(cwd)


def test_environment_and_limits_are_not_inherited(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_TEST_SECRET", "s3cret")
    assert run_python("import os\nprint(os.environ.get('FLYWHEEL_TEST_SECRET'))").output == "None\n"
    raise_limit = "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))"
    assert "not allowed" in run_python(raise_limit).error
    assert "not allowed" in run_python("import os\nos.kill(os.getppid(), 0)").error


def test_concurrent_calls_do_not_mix() -> None:
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda i: run_python(f"print({i} * 7)"), range(8)))
    assert [r.output for r in results] == [f"{i * 7}\n" for i in range(8)]
