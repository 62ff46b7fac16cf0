"""A Prefect server, the deployments of prefect.yaml and one flow run through a worker, for the
Prefect UI browser test: the pieces of ``flywheel serve`` (flywheel/serve.py) on a free port,
with everything under a temporary folder.

    with prefect_server(tmp_path / "prefect-home") as (url, home):
        run_id = run_deployment(url, home, tmp_path, "stage/default", name="expert", round=0)
        run_worker_once(url, home, tmp_path / "worker.log")
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from flywheel import serve

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def prefect_server(home: Path, timeout: float = 120.0) -> Iterator[tuple[str, Path]]:
    """A Prefect server (its UI at the root, its API under /api) with the deployments of
    prefect.yaml on the process pool; yields (base URL, PREFECT_HOME); stopped (its process
    group) on the way out."""
    port = free_port()
    proc = serve.start_server(home, HOST, port)
    try:
        url = f"http://{HOST}:{port}"
        serve.wait_healthy(proc, f"{url}/api", home / "server.log", timeout=timeout)
        serve.ensure_pool(f"{url}/api", serve.DEFAULT_POOL, home)
        serve.deploy(f"{url}/api", serve.DEFAULT_POOL, home, ROOT)
        yield url, home
    finally:
        serve.stop(proc)


def run_deployment(url: str, home: Path, cwd: Path, deployment: str, **params: Any) -> str:
    """``prefect deployment run DEPLOYMENT -p key=value ...`` (values as JSON); the run's id."""
    cmd = [serve.prefect_bin(), "deployment", "run", deployment]
    for key, value in params.items():
        cmd += ["-p", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    env = serve.prefect_env(home, f"{url}/api")
    out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    found = re.search(r"UUID: ([0-9a-f-]{36})", out.stdout)
    assert found, out.stdout
    return found.group(1)


def run_worker_once(url: str, home: Path, log: Path, timeout: float = 240.0) -> None:
    """A process worker that takes the scheduled run, runs it and exits (``--run-once``)."""
    with open(log, "w") as fh:
        worker = serve.start_worker(
            f"{url}/api", serve.DEFAULT_POOL, home, run_once=True, stdout=fh
        )
    try:
        worker.wait(timeout)
    finally:
        serve.stop(worker)


def flow_run(url: str, run_id: str) -> dict[str, Any]:
    return httpx.get(f"{url}/api/flow_runs/{run_id}", timeout=10).json()


def task_runs(url: str, run_id: str) -> list[dict[str, Any]]:
    body = {"task_runs": {"flow_run_id": {"any_": [run_id]}}}
    return httpx.post(f"{url}/api/task_runs/filter", json=body, timeout=10).json()


def logs(url: str, run_id: str) -> list[dict[str, Any]]:
    body = {"logs": {"flow_run_id": {"any_": [run_id]}}, "sort": "TIMESTAMP_ASC"}
    return httpx.post(f"{url}/api/logs/filter", json=body, timeout=10).json()
