"""MLflow tracking: the flows log one parent run, a nested run per round and a nested run per
stage (params = the stage's config, metrics = its summary, tags = artifact ids), read back with
``MlflowClient``; and ``Tracker`` logging over HTTP to a real ``mlflow server`` on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import stages.expert
import stages.tasks
from flywheel.config import load_config
from flywheel.store import Store
from flywheel.tracking import Tracker, _flatten
from tests.conftest import run_flywheel, stage_lines

EXPERIMENT = "flywheel-test"


def runs_by_id(uri: str, experiment: str) -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment} at {uri}"
    return {r.info.run_id: r for r in client.search_runs([exp.experiment_id], max_results=1000)}


def check_stage_run(run, ref) -> None:
    """A stage run's tags, params and metrics are the artifact's id, config and summary."""
    assert run.info.run_name == ref.stage
    assert run.data.tags["artifact_id"] == ref.id
    assert run.data.tags["kind"] == ref.kind
    assert run.data.tags["round"] == str(ref.round)
    assert run.data.tags["inputs"] == ",".join(ref.inputs)
    expected = {k: str(v) for k, v in _flatten(ref.manifest["config"]).items()}
    assert run.data.params == expected
    numeric = {
        k: float(v)
        for k, v in ref.summary.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    assert numeric, f"{ref.id} has no numeric summary"
    metrics = {k: v for k, v in run.data.metrics.items() if not k.startswith("train/")}
    assert metrics == pytest.approx(numeric, nan_ok=True)
    assert run.info.status == "FINISHED"


@pytest.mark.slow
def test_flows_log_nested_runs(tiny_flywheel, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = [
        *tiny_flywheel.overrides,
        "tracking.enabled=true",
        f"tracking.uri={uri}",
        f"tracking.experiment={EXPERIMENT}",
    ]
    printed, _, _ = run_flywheel(overrides, rounds=1)
    lines = stage_lines(printed)
    assert lines and all(hit for _, _, hit, _ in lines)  # tracking is not part of any artifact id

    runs = runs_by_id(uri, EXPERIMENT)
    parent_of = {rid: r.data.tags.get("mlflow.parentRunId") for rid, r in runs.items()}
    top = [rid for rid, p in parent_of.items() if p is None]
    assert len(top) == 1
    parent = runs[top[0]]
    assert parent.info.run_name == "tiny" and parent.info.status == "FINISHED"
    cfg = load_config(None, overrides)
    assert parent.data.params["sft.lr"] == str(cfg.sft.lr)
    assert parent.data.params["envs.arith.n_train"] == "24"

    rounds = {runs[rid].info.run_name: rid for rid, p in parent_of.items() if p == top[0]}
    assert set(rounds) == {"round-0", "round-1"}
    assert all(runs[rid].info.status == "FINISHED" for rid in rounds.values())

    stage_runs = [r for rid, r in runs.items() if parent_of[rid] in rounds.values()]
    assert len(stage_runs) == len(lines)
    assert len(runs) == 1 + len(rounds) + len(lines)
    store = Store(cfg.run.store_root(), cfg.run.name)
    by_artifact = {r.data.tags["artifact_id"]: r for r in stage_runs}
    assert set(by_artifact) == {art_id for *_, art_id in lines}
    for round_, _, _, art_id in lines:
        run = by_artifact[art_id]
        assert parent_of[run.info.run_id] == rounds[f"round-{round_}"]
        assert run.data.tags["cached"] == "true"
        check_stage_run(run, store.get(art_id))

    # the training curve of the bootstrap sft, and the manifest as an artifact
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    sft_id = next(a for r, s, _, a in lines if (r, s) == (0, "sft"))
    curve = client.get_metric_history(by_artifact[sft_id].info.run_id, "train/loss")
    assert [m.step for m in curve] == [1, 2, 3]
    assert curve[-1].value == pytest.approx(store.get(sft_id).summary["final_loss"])
    assert "manifest.json" in [
        f.path for f in client.list_artifacts(by_artifact[sft_id].info.run_id)
    ]


def test_disabled_tracker_is_a_no_op(tmp_path):
    uri = f"sqlite:///{tmp_path / 'off' / 'mlflow.db'}"
    tracker = Tracker(uri, EXPERIMENT, enabled=False)
    assert tracker.start("x") is None and tracker.round_run(None, 0) is None
    tracker.log_params("run", {"a": 1})
    tracker.log_metrics("run", {"a": 1.0})
    tracker.end("run")
    assert not (tmp_path / "off").exists()
    assert Tracker(None, EXPERIMENT).enabled is False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"mlflow server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"mlflow server not healthy after {timeout:.0f}s:\n{log.read_text()[-3000:]}")


@pytest.mark.integration
@pytest.mark.slow
def test_tracker_logs_to_a_real_mlflow_server(tiny_config, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "mlflow-server.log"
    cmd = [
        str(Path(sys.executable).parent / "mlflow"), "server",
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
        "--artifacts-destination", str(tmp_path / "artifacts"),
    ]  # fmt: skip
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        cfg = tiny_config
        store = Store(cfg.run.store_root(), cfg.run.name)
        tasks, val, _ = stages.tasks.run(cfg, store)
        expert = stages.expert.run(cfg, store, tasks, val)
        wait_healthy(url, proc, log)

        tracker = Tracker(url, EXPERIMENT)
        parent = tracker.start("tiny", tags={"run": "tiny"})
        tracker.log_params(parent, cfg.model_dump())
        tracker.log_stage(parent, store, tasks, cached=False)
        tracker.log_stage(parent, store, expert, cached=True)
        tracker.end(parent)

        runs = runs_by_id(url, EXPERIMENT)
        assert len(runs) == 4  # the parent, round 0, two stages
        assert runs[parent].data.params["envs.arith.n_test"] == "8"
        round0 = [r for r in runs.values() if r.info.run_name == "round-0"]
        assert len(round0) == 1 and round0[0].data.tags["mlflow.parentRunId"] == parent
        stage_runs = {
            r.data.tags.get("artifact_id"): r for r in runs.values() if "artifact_id" in r.data.tags
        }
        assert set(stage_runs) == {tasks.id, expert.id}
        for ref, cached in ((tasks, "false"), (expert, "true")):
            run = stage_runs[ref.id]
            assert run.data.tags["mlflow.parentRunId"] == round0[0].info.run_id
            assert run.data.tags["cached"] == cached
            check_stage_run(run, ref)
        from mlflow.tracking import MlflowClient

        files = MlflowClient(tracking_uri=url).list_artifacts(stage_runs[expert.id].info.run_id)
        assert [f.path for f in files] == ["manifest.json"]
        assert list((tmp_path / "artifacts").rglob("manifest.json")), (
            "the server stored no artifact"
        )
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(20)
