"""The deployments of prefect.yaml against a real Prefect server on 127.0.0.1: deploy them,
run the cheap ``tasks`` stage through ``prefect deployment run 'stage/default'`` and a worker,
and check that the flow run completes and its artifact lands in the store; then ``serve()``
itself, stopped by SIGTERM.

    .venv/bin/python -m pytest tests/integration -q -m integration
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from flywheel import serve
from tests.browser.prefect_helpers import HOST, ROOT
from tests.browser.prefect_helpers import free_port as _free_port


@pytest.fixture
def prefect_server(tmp_path: Path):
    """A Prefect server with its own PREFECT_HOME under tmp_path; killed (process group) after."""
    home = tmp_path / "prefect-home"
    port = _free_port()
    proc = serve.start_server(home, HOST, port)
    try:
        api_url = f"http://{HOST}:{port}/api"
        serve.wait_healthy(proc, api_url, home / "server.log", timeout=120)
        yield api_url, home
    finally:
        serve.stop(proc)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stage_deployment_runs_the_tasks_stage(prefect_server, tmp_path: Path) -> None:
    api_url, home = prefect_server
    serve.ensure_pool(api_url, serve.DEFAULT_POOL, home)
    serve.deploy(api_url, serve.DEFAULT_POOL, home, ROOT)
    names = {d["name"] for d in httpx.post(f"{api_url}/deployments/filter", json={}).json()}
    assert names == {"default"}

    work = tmp_path / "work"
    overrides = [
        f"run.work_dir={work}",
        "envs.arith.n_train=8",
        "envs.arith.n_val=2",
        "envs.arith.n_test=4",
        "tracking.enabled=false",
    ]
    cmd = [serve.prefect_bin(), "deployment", "run", "stage/default"]
    cmd += ["-p", "name=tasks", "-p", "round=0", "-p", f"overrides={json.dumps(overrides)}"]
    env = serve.prefect_env(home, api_url)
    out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    run_id = re.search(r"UUID: ([0-9a-f-]{36})", out.stdout).group(1)

    log = tmp_path / "worker.log"
    with open(log, "w") as fh:
        worker = serve.start_worker(api_url, serve.DEFAULT_POOL, home, run_once=True, stdout=fh)
    try:
        worker.wait(180)
    finally:
        serve.stop(worker)

    state = httpx.get(f"{api_url}/flow_runs/{run_id}").json()["state"]
    assert state["type"] == "COMPLETED", f"{state}\n{log.read_text()[-4000:]}"
    manifests = list((work / "store" / "default" / "round-0" / "tasks").glob("*/manifest.json"))
    assert len(manifests) == 3, log.read_text()[-4000:]  # one artifact per split
    by_split = {m["split"]: m for m in (json.loads(p.read_text()) for p in manifests)}
    assert {m["kind"] for m in by_split.values()} == {"tasks"}
    assert [by_split[s]["rows"] for s in ("train", "val", "test")] == [8, 2, 4]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_serve_deploys_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = _free_port()
    env = dict(os.environ, FLYWHEEL_WORK_DIR=str(tmp_path / "work"))
    code = f"import sys; from flywheel.serve import serve; sys.exit(serve(port={port}))"
    log = tmp_path / "serve.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180
        while "Prefect UI" not in log.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        assert proc.poll() is None, log.read_text()
        api_url = f"http://{HOST}:{port}/api"
        flows = {f["id"]: f["name"] for f in httpx.post(f"{api_url}/flows/filter", json={}).json()}
        deployments = httpx.post(f"{api_url}/deployments/filter", json={}).json()
        assert {f"{flows[d['flow_id']]}/{d['name']}" for d in deployments} == set(serve.DEPLOYMENTS)
        assert all(d["work_pool_name"] == serve.DEFAULT_POOL for d in deployments)
        assert "export PREFECT_API_URL=" + api_url in log.read_text()

        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
        assert serve.port_is_free(HOST, port), "the server outlived serve()"
    finally:
        serve.stop(proc)


@pytest.mark.integration
def test_serve_reports_a_busy_port(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("FLYWHEEL_WORK_DIR", str(tmp_path / "work"))
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        sock.listen()
        assert serve.serve(port=sock.getsockname()[1]) == 1
    err = capsys.readouterr().err
    assert "is busy" in err and len(err.strip().splitlines()) == 1
