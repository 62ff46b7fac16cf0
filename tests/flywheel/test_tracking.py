"""MLflow tracking: the run tree (parent run named after the config and start time, a run per
round, a run per stage artifact), the learning curve on the parent run, the model registry, and
the cached-rerun rule (an artifact that already has a run is not logged again; a flow run that
logs nothing new creates no run). Read back with ``MlflowClient``; also ``Tracker`` logging over
HTTP to a real ``mlflow server`` on 127.0.0.1."""

from __future__ import annotations

import os
import re
import shutil
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
from flywheel.store import ArtifactRef, Store, flatten_config
from flywheel.tracking import (
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    Tracker,
    headline,
    model_name,
)
from tests.conftest import run_flywheel, stage_lines

EXPERIMENT = "flywheel-test"
PARENT_NAME = re.compile(r"^(?P<name>\S+) \d{4}-\d\d-\d\d \d\d:\d\d$")
MLFLOW_LINE = re.compile(r"^MLflow: http://\S+/#/experiments/\d+/runs/(\w+)\?workflowType=", re.M)


def client_for(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def runs_by_id(uri: str, experiment: str) -> dict:
    client = client_for(uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment} at {uri}"
    return {r.info.run_id: r for r in client.search_runs([exp.experiment_id], max_results=1000)}


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client_for(uri).get_metric_history(run_id, key))


def check_stage_run(run, ref) -> None:
    """A stage run's tags, params and metrics are the artifact's id, config and summary, and the
    stage's time."""
    assert run.info.run_name == ref.stage
    assert run.data.tags["artifact_id"] == ref.id
    assert run.data.tags["kind"] == ref.kind
    assert run.data.tags["round"] == str(ref.round)
    assert run.data.tags["inputs"] == ",".join(ref.inputs)
    expected = {k: str(v) for k, v in flatten_config(ref.manifest["config"]).items()}
    assert run.data.params == expected
    numeric = {
        k: float(v)
        for k, v in ref.summary.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    assert numeric, f"{ref.id} has no numeric summary"
    numeric["stage_seconds"] = ref.manifest["seconds"]  # how long the stage took (its manifest)
    metrics = {k: v for k, v in run.data.metrics.items() if not k.startswith("train/")}
    assert metrics == pytest.approx(numeric, nan_ok=True)
    assert run.info.status == "FINISHED"


# -- the tracker on hand-made artifacts (fast) -------------------------------------------------


def fake_refs(
    store_dir: Path, rates: dict[str, float], baseline: str = "sft_more-eee"
) -> list[ArtifactRef]:
    """Checkpoints and their evaluations of a 2-round flywheel, as the flows log them: the
    untrained init policy, sft (round 0), dpo in rounds 1 and 2, then the sft_more baseline.
    ``rates`` maps each checkpoint id to its success rate; ``baseline`` is sft_more's id."""
    refs = []
    for ckpt, stage, round_ in (
        ("init-aaa", "init", 0),
        ("sft-bbb", "sft", 0),
        ("dpo-ccc", "dpo", 1),
        ("dpo-ddd", "dpo", 2),
        (baseline, "sft_more", 2),
    ):
        folder = store_dir / ckpt
        folder.mkdir(parents=True, exist_ok=True)
        config = {"lr": 0.001, "round": round_}
        refs.append(
            ArtifactRef(ckpt, "checkpoints", stage, round_, str(folder), {"config": config})
        )
        rate = rates[ckpt]
        summary = {
            "arith/success_rate": rate,
            "arith/avg_reward": rate / 2,
            "arith/efficiency": rate / 4,
            "arith/n_tasks": 8,
            "arith/success_rate_d1": min(1.0, 2 * rate),
        }
        manifest = {
            "config": {"temperature": 0.0},
            "summary": summary,
            "inputs": [ckpt],
            "policy": ckpt,
            "policy_stage": stage,
        }
        refs.append(ArtifactRef(f"evaluate-{ckpt}", "eval", "evaluate", round_, "", manifest))
    return refs


def walk(tracker: Tracker, store: Store, refs: list[ArtifactRef], status="FINISHED") -> str | None:
    tracker.begin("unit", run="unit", rounds=2, params={"sft": {"lr": 0.001}})
    for ref in refs:
        tracker.log_stage(store, ref, cached=False)
    return tracker.finish(status)


RATES = {
    "init-aaa": 0.125,
    "sft-bbb": 0.25,
    "dpo-ccc": 0.5,
    "dpo-ddd": 0.625,
    "sft_more-eee": 0.375,
}


def test_tracker_logs_the_learning_curve_and_reuses_runs_of_logged_artifacts(tmp_path):
    uri = f"sqlite:///{tmp_path / 'work' / 'mlflow.db'}"
    store = Store(str(tmp_path / "store"), "unit")
    refs = fake_refs(tmp_path / "store", RATES)
    tracker = Tracker(uri, EXPERIMENT)
    parent = walk(tracker, store, refs)
    client = client_for(uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    assert exp.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    assert exp.artifact_location == (tmp_path / "work" / "mlartifacts").as_uri()

    runs = runs_by_id(uri, EXPERIMENT)
    assert len(runs) == 1 + 3 + len(refs)  # the parent, rounds 0-2, one run per artifact
    top = [r for r in runs.values() if "mlflow.parentRunId" not in r.data.tags]
    assert [r.info.run_id for r in top] == [parent]
    match = PARENT_NAME.match(runs[parent].info.run_name)
    assert match and match["name"] == "unit", runs[parent].info.run_name
    assert runs[parent].data.params == {"sft.lr": "0.001"}
    assert runs[parent].info.status == "FINISHED"

    # the learning curve (step = round) and the reference policies as flat lines over 0..2
    for metric, factor in (("success_rate", 1), ("avg_reward", 2), ("efficiency", 4)):
        curve = history(uri, parent, f"arith/{metric}")
        assert curve == [(0, 0.25 / factor), (1, 0.5 / factor), (2, 0.625 / factor)]
        for policy, ckpt in (("init", "init-aaa"), ("sft_more", "sft_more-eee")):
            flat = history(uri, parent, f"arith/{policy}/{metric}")
            assert flat == [(s, RATES[ckpt] / factor) for s in range(3)], (policy, metric)
    assert "arith/n_tasks" not in runs[parent].data.metrics

    # each round's run carries its round policy's whole evaluation (not the baseline's)
    rounds = {
        r.info.run_name: r for r in runs.values() if r.data.tags.get("mlflow.parentRunId") == parent
    }
    assert set(rounds) == {"round-0", "round-1", "round-2"}
    by_id = {ref.id: ref for ref in refs}
    for round_, ckpt in ((0, "sft-bbb"), (1, "dpo-ccc"), (2, "dpo-ddd")):
        summary = by_id[f"evaluate-{ckpt}"].summary
        assert rounds[f"round-{round_}"].data.metrics == pytest.approx(summary)

    # every checkpoint is a model version: source = its folder, tags = id and eval metrics
    versions = client.search_model_versions(f"name = '{model_name('unit')}'")
    assert len(versions) == 5
    stage_runs = {
        r.data.tags["artifact_id"]: r.info.run_id
        for r in runs.values()
        if "artifact_id" in r.data.tags
    }
    for v in versions:
        ckpt = v.tags["artifact_id"]
        assert v.source == str(tmp_path / "store" / ckpt)
        assert v.run_id == stage_runs[ckpt]
        assert v.tags["eval_id"] == f"evaluate-{ckpt}"
        assert {k: float(v.tags[k]) for k in headline(by_id[f"evaluate-{ckpt}"])} == (
            headline(by_id[f"evaluate-{ckpt}"])
        )

    # a rerun where every artifact already has its run: no new run, no new version, same parent
    again = Tracker(uri, EXPERIMENT)
    assert walk(again, store, refs) == parent
    assert set(runs_by_id(uri, EXPERIMENT)) == set(runs)
    assert len(client.search_model_versions(f"name = '{model_name('unit')}'")) == 5
    assert history(uri, parent, "arith/success_rate") == [(0, 0.25), (1, 0.5), (2, 0.625)]

    # a changed baseline: a new parent with the whole curve, and runs for the new artifacts only
    changed = fake_refs(tmp_path / "store", {**RATES, "sft_more-fff": 0.75}, "sft_more-fff")
    new_parent = walk(Tracker(uri, EXPERIMENT), store, changed)
    after = runs_by_id(uri, EXPERIMENT)
    added = {rid: r for rid, r in after.items() if rid not in runs}
    assert new_parent in added and new_parent != parent
    assert sorted(r.info.run_name for r in added.values()) == sorted(
        [after[new_parent].info.run_name, "round-2", "sft_more", "evaluate"]
    )
    assert history(uri, new_parent, "arith/success_rate") == [(0, 0.25), (1, 0.5), (2, 0.625)]
    assert history(uri, new_parent, "arith/sft_more/success_rate") == [(s, 0.75) for s in range(3)]
    assert history(uri, new_parent, "arith/init/success_rate") == [(s, 0.125) for s in range(3)]
    assert len(client.search_model_versions(f"name = '{model_name('unit')}'")) == 6


def test_a_repeat_of_the_last_round_is_a_series_of_its_own(tmp_path):
    """iteration.repeats: round 2 trained again (dpo-rep, 0.75) after the run's own round 2
    (dpo-ddd, 0.625). The learning curve and the round-2 run keep the run's own numbers; the
    repeat's evaluation is a point of ``arith/repeat/success_rate`` at step 2, and its stage
    runs are tagged ``repeat``."""
    uri = f"sqlite:///{tmp_path / 'work' / 'mlflow.db'}"
    store = Store(str(tmp_path / "store"), "unit")
    rates = {**RATES, "dpo-rep": 0.75}
    refs = fake_refs(tmp_path / "store", rates)
    (ckpt, evaluation) = [r for r in refs if r.id.endswith("dpo-ddd")]
    folder = tmp_path / "store" / "dpo-rep"
    folder.mkdir()
    repeat = [
        ArtifactRef("dpo-rep", "checkpoints", "dpo", 2, str(folder), ckpt.manifest),
        ArtifactRef(
            "evaluate-dpo-rep", "eval", "evaluate", 2, "",
            {**evaluation.manifest, "policy": "dpo-rep", "inputs": ["dpo-rep"],
             "summary": {**evaluation.summary, "arith/success_rate": 0.75}},
        ),
    ]  # fmt: skip
    tracker = Tracker(uri, EXPERIMENT)
    tracker.begin("unit", run="unit", rounds=2, params={})
    for ref in refs:
        tracker.log_stage(store, ref, cached=False)
    for ref in repeat:
        tracker.log_stage(store, ref, cached=False, repeat=True)
    parent = tracker.finish("FINISHED")
    assert history(uri, parent, "arith/success_rate") == [(0, 0.25), (1, 0.5), (2, 0.625)]
    assert history(uri, parent, "arith/repeat/success_rate") == [(2, 0.75)]
    runs = runs_by_id(uri, EXPERIMENT)
    (round2,) = [r for r in runs.values() if r.info.run_name == "round-2"]
    assert round2.data.metrics["arith/success_rate"] == 0.625
    tagged = {r.data.tags["artifact_id"] for r in runs.values() if r.data.tags.get("repeat")}
    assert tagged == {"dpo-rep", "evaluate-dpo-rep"}


def test_a_search_stage_run_carries_its_tree_metrics_and_its_picture(tmp_path):
    """The mcts stage's run: tree size, depth, share of trees with a success as metrics, and the
    tree.png of its artifact folder as a file of the run (what the MLflow UI shows)."""
    from PIL import Image

    uri = f"sqlite:///{tmp_path / 'work' / 'mlflow.db'}"
    store = Store(str(tmp_path / "store"), "unit")
    folder = tmp_path / "store" / "mcts-abc"
    folder.mkdir(parents=True)
    Image.new("RGB", (8, 8), "white").save(folder / "tree.png")
    summary = {
        "craft/trees": 16.0,
        "craft/nodes_per_tree": 9.5,
        "craft/max_depth_mean": 3.25,
        "craft/success_share": 0.5,
    }
    manifest = {
        "config": {"n_gen": 4},
        "summary": summary,
        "inputs": ["sft-bbb", "tasks-x"],
        "seconds": 12.5,
    }
    ref = ArtifactRef("mcts-abc", "trees", "mcts", 1, str(folder), manifest)
    tracker = Tracker(uri, EXPERIMENT)
    tracker.begin("unit", run="unit", rounds=1, params={})
    tracker.log_stage(store, ref, cached=False)
    tracker.finish("FINISHED")

    (run,) = [r for r in runs_by_id(uri, EXPERIMENT).values() if r.info.run_name == "mcts"]
    check_stage_run(run, ref)
    files = {f.path for f in client_for(uri).list_artifacts(run.info.run_id)}
    assert {"tree.png", "manifest.json"} <= files, files


def test_a_failed_run_gets_a_parent_run_even_when_nothing_was_new(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    store = Store(str(tmp_path / "store"), "unit")
    refs = fake_refs(tmp_path / "store", RATES)
    first = walk(Tracker(uri, EXPERIMENT), store, refs)
    failed = walk(Tracker(uri, EXPERIMENT), store, refs[:3], status="FAILED")
    runs = runs_by_id(uri, EXPERIMENT)
    assert failed not in (None, first)
    assert runs[failed].info.status == "FAILED"
    assert history(uri, failed, "arith/init/success_rate") == [(s, 0.125) for s in range(3)]
    assert len(runs) == 1 + 3 + len(refs) + 1  # only the failed parent was added


def test_an_existing_experiment_gets_the_experiment_kind(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = client_for(uri)
    exp_id = client.create_experiment(EXPERIMENT)
    assert EXPERIMENT_KIND_TAG not in client.get_experiment(exp_id).tags
    tracker = Tracker(uri, EXPERIMENT)
    assert tracker.experiment_id == exp_id
    assert client.get_experiment(exp_id).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    base = f"http://127.0.0.1:5000/#/experiments/{exp_id}"
    assert tracker.ui_url() == f"{base}?workflowType=machine_learning"
    assert tracker.ui_url("abc") == f"{base}/runs/abc?workflowType=machine_learning"


def test_disabled_tracker_is_a_no_op(tmp_path):
    uri = f"sqlite:///{tmp_path / 'off' / 'mlflow.db'}"
    tracker = Tracker(uri, EXPERIMENT, enabled=False)
    assert tracker.start("x") is None and tracker.round_run(None, 0) is None
    tracker.log_params("run", {"a": 1})
    tracker.log_metrics("run", {"a": 1.0})
    tracker.log_file("run", tmp_path / "missing.html")
    tracker.end("run")
    tracker.begin("x", run="x", rounds=1)
    store = Store(str(tmp_path / "store"), "x")
    for ref in fake_refs(tmp_path / "ckpts", RATES):
        tracker.log_stage(store, ref, cached=True)
    assert tracker.finish() is None
    assert not (tmp_path / "off").exists()
    assert Tracker(None, EXPERIMENT).enabled is False


# -- the flows (slow) --------------------------------------------------------------------------


@pytest.mark.slow
def test_flows_log_the_run_tree_once(tiny_flywheel, tmp_path):
    """The tiny flywheel (1 round, already in the store) with tracking on: one parent run named
    after the config, its learning curve, a run per artifact, a version per checkpoint; run
    again, it adds nothing; with a changed rft config it adds a parent and rft's runs only."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # a copy of the shared store: the changed-rft run below must not add to the shared one
    shutil.copytree(tiny_flywheel.root / "store", tmp_path / "store")
    overrides = [
        *tiny_flywheel.overrides,
        f"run.store={tmp_path / 'store'}",
        f"run.work_dir={tmp_path / 'work'}",
        "tracking.enabled=true",
        f"tracking.uri={uri}",
        f"tracking.experiment={EXPERIMENT}",
    ]
    printed, _, _ = run_flywheel(overrides, rounds=1)
    lines = stage_lines(printed)
    assert lines and all(hit for _, _, hit, _ in lines)  # tracking is not part of any artifact id
    parents = MLFLOW_LINE.findall(printed)
    assert len(parents) == 1, printed[-2000:]

    runs = runs_by_id(uri, EXPERIMENT)
    parent_of = {rid: r.data.tags.get("mlflow.parentRunId") for rid, r in runs.items()}
    top = [rid for rid, p in parent_of.items() if p is None]
    assert top == parents
    # the run's HTML report is an artifact of the parent run
    logged = {f.path for f in client_for(uri).list_artifacts(top[0], "report")}
    assert {"report/index.html", "report/trajectories"} <= logged, logged
    parent = runs[top[0]]
    match = PARENT_NAME.match(parent.info.run_name)
    assert match and match["name"] == "tiny" and parent.info.status == "FINISHED"
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

    # the learning curve: each round's policy at step = round, init and baselines as flat lines
    evals = [store.get(a) for _, s, _, a in lines if s == "evaluate"]
    by_policy = {(e.round, e.manifest["policy_stage"]): e for e in evals}
    assert set(by_policy) == {(0, "init"), (0, "sft"), (1, "dpo"), (1, "sft_more"), (1, "rft")}
    curve = history(uri, top[0], "arith/success_rate")
    assert curve == [
        (0, by_policy[0, "sft"].summary["arith/success_rate"]),
        (1, by_policy[1, "dpo"].summary["arith/success_rate"]),
    ]
    for (_, policy), ref in by_policy.items():
        if policy in ("init", "sft_more", "rft"):
            flat = history(uri, top[0], f"arith/{policy}/efficiency")
            assert flat == [(s, ref.summary["arith/efficiency"]) for s in (0, 1)]
    assert runs[rounds["round-1"]].data.metrics == pytest.approx(by_policy[1, "dpo"].summary)

    # every checkpoint (init, sft, dpo, sft_more, rft) is a version with its eval's numbers
    client = client_for(uri)
    versions = client.search_model_versions(f"name = '{model_name('tiny')}'")
    checkpoints = [store.get(a) for *_, a in lines if store.get(a).kind == "checkpoints"]
    assert sorted(v.tags["artifact_id"] for v in versions) == sorted(c.id for c in checkpoints)
    for v in versions:
        ckpt = store.get(v.tags["artifact_id"])
        assert v.source == str(store.local_path(ckpt))
        ev = next(e for e in evals if e.manifest["policy"] == ckpt.id)
        assert v.tags["eval_id"] == ev.id
        assert float(v.tags["arith/success_rate"]) == ev.summary["arith/success_rate"]

    # the training curve of the bootstrap sft, and the manifest as an artifact
    sft_id = next(a for r, s, _, a in lines if (r, s) == (0, "sft"))
    train = client.get_metric_history(by_artifact[sft_id].info.run_id, "train/loss")
    assert [m.step for m in train] == [1, 2, 3]
    assert train[-1].value == pytest.approx(store.get(sft_id).summary["final_loss"])
    assert "manifest.json" in [
        f.path for f in client.list_artifacts(by_artifact[sft_id].info.run_id)
    ]

    # the same flywheel again: no new run, no new version; it reports the same parent run
    printed, _, _ = run_flywheel(overrides, rounds=1)
    assert MLFLOW_LINE.findall(printed) == parents
    assert set(runs_by_id(uri, EXPERIMENT)) == set(runs)
    assert len(client.search_model_versions(f"name = '{model_name('tiny')}'")) == len(versions)

    # a changed rft: a new parent with a round-1 run holding rft and its evaluation only
    printed, _, _ = run_flywheel([*overrides, "rft.per_task=2"], rounds=1)
    (new_parent,) = MLFLOW_LINE.findall(printed)
    after = runs_by_id(uri, EXPERIMENT)
    added = sorted(r.info.run_name for rid, r in after.items() if rid not in runs)
    assert new_parent not in runs and new_parent in after
    assert added == sorted([after[new_parent].info.run_name, "round-1", "rft", "evaluate"])
    assert history(uri, new_parent, "arith/success_rate") == curve
    assert len(client.search_model_versions(f"name = '{model_name('tiny')}'")) == len(versions) + 1


# -- a real tracking server ----------------------------------------------------------------


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


def start_server(
    backend: str, folder: Path, extra: tuple[str, ...] = ()
) -> tuple[str, subprocess.Popen]:
    """``mlflow server`` on a free 127.0.0.1 port, in its own process group (see stop_server)."""
    port = free_port()
    log = folder / "mlflow-server.log"
    cmd = [
        str(Path(sys.executable).parent / "mlflow"), "server",
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", backend, *extra,
    ]  # fmt: skip
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
    except BaseException:
        stop_server(proc)
        raise
    return url, proc


def stop_server(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(20)


@pytest.mark.integration
@pytest.mark.slow
def test_tracker_logs_to_a_real_mlflow_server(tiny_config, tmp_path):
    cfg = tiny_config
    store = Store(cfg.run.store_root(), cfg.run.name)
    tasks, val, _ = stages.tasks.run(cfg, store)
    expert = stages.expert.run(cfg, store, tasks, val)
    url, proc = start_server(
        f"sqlite:///{tmp_path / 'server.db'}",
        tmp_path,
        ("--artifacts-destination", str(tmp_path / "artifacts")),
    )
    try:
        tracker = Tracker(url, EXPERIMENT)
        tracker.begin("tiny", run="tiny", rounds=0, params=cfg.model_dump())
        tracker.log_stage(store, tasks, cached=False)
        tracker.log_stage(store, expert, cached=True)
        parent = tracker.finish()
        assert parent is not None

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
        files = client_for(url).list_artifacts(stage_runs[expert.id].info.run_id)
        assert [f.path for f in files] == ["manifest.json"]
        assert list((tmp_path / "artifacts").rglob("manifest.json")), (
            "the server stored no artifact"
        )

        report = tmp_path / "report.html"
        report.write_text("<html>report</html>")
        tracker.log_file(parent, report)
        assert "report.html" in [f.path for f in client_for(url).list_artifacts(parent)]

        # the same artifacts again, over HTTP: the runs are found and reused
        again = Tracker(url, EXPERIMENT)
        again.begin("tiny", run="tiny", rounds=0)
        again.log_stage(store, tasks, cached=True)
        again.log_stage(store, expert, cached=True)
        assert again.finish() == parent
        assert set(runs_by_id(url, EXPERIMENT)) == set(runs)
    finally:
        stop_server(proc)
