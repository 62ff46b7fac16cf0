"""``flywheel`` through ``flywheel.cli.main``: every error is one line on stderr starting with
``flywheel: error:`` and a non-zero exit, and a failed command leaves nothing half-written; plus
the read-only commands (artifacts ls / show / lineage, config --fields) on a real small store."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

import stages.expert
import stages.tasks
from flywheel.cli import main
from flywheel.config import field_help, load_config
from flywheel.progress import duration
from flywheel.report import STATE_FILE
from flywheel.store import Store
from tests.conftest import tiny_overrides, write_tiny_yaml


@pytest.fixture
def small_store(tmp_path):
    """tasks and expert artifacts of the tiny config, and its YAML file."""
    path = write_tiny_yaml(tmp_path)
    cfg = load_config(path)
    store = Store(cfg.run.store_root(), cfg.run.name)
    tasks, val, test = stages.tasks.run(cfg, store)
    expert = stages.expert.run(cfg, store, tasks, val)
    return path, store, (tasks, val, test), expert


def folders(root: Path) -> set[str]:
    """Every file and folder under the store (a failed command must add none)."""
    return {str(p.relative_to(root)) for p in root.rglob("*")} if root.exists() else set()


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, *needles: str) -> str:
    assert rc != 0
    lines = err.splitlines()
    assert len(lines) == 1, f"stderr is not one line:\n{err}"
    assert lines[0].startswith("flywheel: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


# -- config errors -------------------------------------------------------------------------------


def test_unknown_override_key_is_one_line_and_starts_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/default.yaml here: the built-in defaults
    before = folders(tmp_path)
    rc, out, err = run_cli(capsys, "run", "nope.x=1")
    assert_one_line_error(rc, err, "unknown key nope")
    assert out == ""
    assert folders(tmp_path) == before  # no work/ folder, no store, no Prefect database


def test_overrides_may_follow_options():
    from flywheel.cli import _parse

    args = _parse(["stage", "grpo", "--round", "1", "grpo.lr=1e-3", "run.seed=-1"])
    assert (args.name, args.round, args.overrides) == ("grpo", 1, ["grpo.lr=1e-3", "run.seed=-1"])
    args = _parse(["run", "a.b=1", "--rounds", "2", "c.d=2"])
    assert (args.rounds, args.overrides) == (2, ["a.b=1", "c.d=2"])
    with pytest.raises(SystemExit):
        _parse(["stage", "grpo", "--round", "1", "--nope"])
    args = _parse(["report", "--json", "run.name=other"])
    assert args.json and args.overrides == ["run.name=other"]
    with pytest.raises(SystemExit):
        _parse(["report", "--json", "--nope"])


def test_unknown_key_in_yaml_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  rounds: 1\nsft:\n  lrr: 0.1\n")
    for argv in (
        ["run", "--config", str(bad)],
        ["stage", "sft", "--round", "0", "--config", str(bad)],
        ["config", "--config", str(bad)],
        ["report", "--config", str(bad)],
    ):
        rc, _, err = run_cli(capsys, *argv)
        assert_one_line_error(rc, err, "unknown key sft.lrr")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def test_bad_value_and_missing_file(tmp_path, capsys):
    rc, _, err = run_cli(capsys, "config", "sft.lr=-1")
    assert_one_line_error(rc, err, "sft.lr")
    rc, _, err = run_cli(capsys, "config", "--config", str(tmp_path / "none.yaml"))
    assert_one_line_error(rc, err, "no such file")
    broken = tmp_path / "broken.yaml"
    broken.write_text("run: [unclosed\n")
    rc, _, err = run_cli(capsys, "config", "--config", str(broken))
    assert_one_line_error(rc, err, "not valid YAML")


def test_a_round_that_splices_an_env_without_a_noop_fails_before_any_work(tmp_path, capsys):
    """An env with no no-op action for a revision turn: with mcts in iteration.data the run stops
    at once (not after the bootstrap and the search) and writes nothing; a walk that stops
    before splice (the bootstrap, or round 1's mcts) is not refused."""
    path = write_tiny_yaml(tmp_path, "envs.0.suite=tests.conftest:ArithWithoutNoop")
    cfg = load_config(path)
    mcts = ["iteration.data=[explore,mcts]", "iteration.steps=[sft]"]
    rc, _, err = run_cli(capsys, "run", "--config", str(path), *mcts)
    assert_one_line_error(rc, err, "splice: env arith names no no-op action", "e.g. craft")
    assert folders(Path(cfg.run.store_root())) == set()
    rc, _, err = run_cli(capsys, "stage", "splice", "--round", "1", "--config", str(path), *mcts)
    assert_one_line_error(rc, err, "splice: env arith names no no-op action")
    assert folders(Path(cfg.run.store_root())) == set()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.yaml"]  # no work folder either
    from flows.walk import splices  # light: the CLI asks it before importing the stages

    with_mcts = load_config(path, mcts)
    assert splices(with_mcts, 2) and not splices(with_mcts, 0)
    for stop, reached in [(("sft", 0), False), (("mcts", 1), False), (("splice", 1), True),
                          (("explore", 2), True), (("evaluate", 1), True)]:  # fmt: skip
        assert splices(with_mcts, stop[1], stop_at=stop) is reached, stop
    assert not splices(cfg, 2)  # no mcts in iteration.data: nothing splices
    # the built-in arith has a no-op: the same rounds pass the check
    import stages.splice

    stages.splice.check_envs(load_config(None, tiny_overrides(tmp_path, *mcts)))


def test_work_beside_the_server_start_runs_once_and_raises_in_the_caller():
    """``_Beside`` (what `flywheel run` imports while Prefect's server starts): run in its own
    thread once started, however often; in the caller when never started (a server already up);
    its exception raised by ``join``, in the caller."""
    import threading

    from flywheel.cli import _Beside

    ran: list[str] = []
    work = _Beside(lambda: ran.append(threading.current_thread().name))
    work.start()
    work.start()
    work.join()
    assert ran == ["beside-server-start"]
    inline = _Beside(lambda: ran.append(threading.current_thread().name))
    inline.join()
    assert ran[1:] == [threading.current_thread().name]

    def fails() -> None:
        raise ImportError("no module named stages")

    broken = _Beside(fails)
    broken.start()
    with pytest.raises(ImportError, match="no module named stages"):
        broken.join()
    _Beside(None).join()  # nothing to do: returns


def test_the_interpreter_waits_for_work_beside_the_server_start(tmp_path):
    """A stop signal ends the server's start and the command returns while the work may still
    run; the interpreter must not finalize under it (as a daemon thread it aborted 3 runs of 14
    with SIGABRT, mid-import). A process that starts the work and exits at once still sees it
    finish."""
    import subprocess
    import sys

    done = tmp_path / "done"
    script = (
        "import time, pathlib\n"
        "from flywheel.cli import _Beside\n"
        f"work = _Beside(lambda: (time.sleep(1.0), pathlib.Path({str(done)!r}).write_text('ok')))\n"
        "work.start()\n"
        "raise SystemExit(143)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 143, proc.stderr
    assert done.is_file(), "the process exited before the work beside the start ended"


PROBE_THE_SERVER_START = """
import json, threading, time
import httpx
from flywheel.cli import _environment, _start_prefect_server
_environment()
from prefect.server.api.server import SubprocessASGIServer
seen = {}
def probe():
    url = SubprocessASGIServer().api_url + "/health"  # the port is chosen: its process runs
    seen["thread"] = threading.current_thread().name
    try:
        seen["answered_at_start"] = httpx.get(url, timeout=0.5).status_code == 200
    except httpx.HTTPError:
        seen["answered_at_start"] = False
    time.sleep(0.5)
    seen["finished"] = time.monotonic()
_start_prefect_server(beside=probe)
seen["returned"] = time.monotonic()
url = SubprocessASGIServer().api_url + "/health"
seen["answers_after"] = httpx.get(url, timeout=10).status_code == 200
SubprocessASGIServer().stop()
print(json.dumps(seen))
"""


def test_the_work_beside_runs_while_prefects_server_starts(tmp_path):
    """The overlap itself: ``_start_prefect_server(beside=...)`` starts the work in its thread
    once the server's process runs and before that server answers, and returns after both the
    work and the start are done. A real temporary server, in a process of its own."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    proc = subprocess.run(
        [sys.executable, "-c", PROBE_THE_SERVER_START],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["thread"] == "beside-server-start", seen
    assert seen["answered_at_start"] is False, f"the work started after the server was up: {seen}"
    assert seen["finished"] <= seen["returned"], seen
    assert seen["answers_after"] is True, seen


def test_get_ready_opens_the_runs_mlflow_database_and_imports_the_stages(tmp_path):
    """What `flywheel run` does while Prefect's server starts: the stages are imported and the
    run's local MLflow database holds its experiment, which the flow's tracker then finds."""
    import sys

    from mlflow.tracking import MlflowClient

    from flywheel.cli import _get_ready

    cfg = load_config(write_tiny_yaml(tmp_path, "tracking.enabled=true"))
    _get_ready(cfg)
    assert "flows.flywheel" in sys.modules
    uri = cfg.tracking_uri()
    assert uri.startswith("sqlite:///") and Path(uri[len("sqlite:///") :]).is_file()
    found = MlflowClient(tracking_uri=uri).get_experiment_by_name(cfg.tracking.experiment)
    assert found is not None
    (tmp_path / "off").mkdir()
    off = load_config(write_tiny_yaml(tmp_path / "off"))  # the tiny config: tracking off
    assert not off.tracking.enabled
    _get_ready(off)
    assert not Path(off.tracking_uri()[len("sqlite:///") :]).exists()  # no database


def test_a_revision_thought_the_tokenizer_cannot_spell_fails_before_any_work(tmp_path, capsys):
    """splice.thoughts with a word the embedded tokenizer lacks: the run stops at once, in one
    line naming the word, and writes nothing; the published thoughts' words pass."""
    path = write_tiny_yaml(tmp_path)
    cfg = load_config(path)
    mcts = ["iteration.data=[explore,mcts]", "iteration.steps=[sft]"]
    rc, _, err = run_cli(capsys, "run", "--config", str(path), *mcts,
                         "splice.thoughts=[Zyzzyva went wrong.]")  # fmt: skip
    assert_one_line_error(rc, err, "splice.thoughts", "cannot spell 'Zyzzyva'")
    assert folders(Path(cfg.run.store_root())) == set()
    from flows.flywheel import check_run

    check_run(load_config(path, [*mcts, "splice.thoughts=[My last action was wrong.]"]), 2)
    # without revisions no thought is written, so none is checked
    check_run(load_config(path, [*mcts, "splice.revisions=false",
                                 "splice.thoughts=[Zyzzyva went wrong.]"]), 2)  # fmt: skip


# -- artifact errors ----------------------------------------------------------------------------


def test_missing_artifact(small_store, capsys):
    path, store, _, _ = small_store
    before = folders(Path(store.base))
    rc, out, err = run_cli(capsys, "artifacts", "--config", str(path), "show", "stage-nope")
    assert_one_line_error(rc, err, "no artifact stage-nope")
    assert out == ""
    rc, _, err = run_cli(
        capsys, "artifacts", "--config", str(path), "lineage", "expert-000000000000"
    )
    assert_one_line_error(rc, err, "no artifact expert-000000000000")
    assert folders(Path(store.base)) == before


def test_truncated_shard(small_store, capsys):
    path, store, _, expert = small_store
    shard = Path(expert.path) / expert.manifest["shards"][0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    before = folders(Path(store.base))
    rc, _, err = run_cli(
        capsys, "artifacts", "--config", str(path), "show", expert.id, "--rows", "2"
    )
    assert_one_line_error(rc, err, "corrupted shard", shard.name)
    assert folders(Path(store.base)) == before


def test_missing_shard(small_store, capsys):
    path, _, _, expert = small_store
    shard = Path(expert.path) / expert.manifest["shards"][0]
    shard.unlink()
    rc, _, err = run_cli(
        capsys, "artifacts", "--config", str(path), "show", expert.id, "--rows", "1"
    )
    assert_one_line_error(rc, err, f"artifact {expert.id} is missing shard")


def test_broken_manifest(small_store, capsys):
    path, store, (tasks, _, _), expert = small_store
    manifest = Path(expert.path) / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])
    state = Path(store.base) / STATE_FILE
    state.write_text(json.dumps({"evaluations": [expert.id]}))
    before = folders(Path(store.base))
    for argv in (
        ["artifacts", "--config", str(path), "show", expert.id],
        ["artifacts", "--config", str(path), "lineage", expert.id],
    ):
        rc, _, err = run_cli(capsys, *argv)
        assert_one_line_error(rc, err, "corrupted manifest", expert.id)
    # ls lists the three readable artifacts and names the broken one on stderr (exit 0)
    rc, out, err = run_cli(capsys, "artifacts", "--config", str(path), "ls")
    assert rc == 0 and len(out.splitlines()) == 3 and expert.id not in out
    assert err.splitlines() == [err.strip()] and err.startswith("flywheel: warning: corrupted")
    assert expert.id in err
    # the report names the evaluations of the last run; one of them is the broken artifact
    rc, _, err = run_cli(capsys, "report", "--config", str(path))
    assert_one_line_error(rc, err, "corrupted manifest")
    state.write_text(json.dumps({"evaluations": [tasks.id]}))
    rc, _, err = run_cli(capsys, "report", "--json", "--config", str(path))
    assert_one_line_error(rc, err, f"artifact {tasks.id} is not an eval artifact")
    assert folders(Path(store.base)) == before


def test_schema_mismatch_names_file_column_and_type(small_store, capsys):
    path, _, _, expert = small_store
    shard = Path(expert.path) / expert.manifest["shards"][0]
    table = pq.read_table(shard)
    idx = table.schema.get_field_index("reward")
    table = table.set_column(
        idx, "reward", pa.array([str(v) for v in table.column("reward").to_pylist()])
    )
    pq.write_table(table, shard)
    rc, out, err = run_cli(
        capsys, "artifacts", "--config", str(path), "show", expert.id, "--rows", "3"
    )
    line = assert_one_line_error(rc, err, "schema mismatch", shard.name, "'reward'", "double")
    assert "string" in line
    # the manifest was printed before the rows were read; no rows were
    assert json.loads(out)["id"] == expert.id


def test_manifest_schema_version_mismatch(small_store, capsys):
    path, _, _, expert = small_store
    manifest = Path(expert.path) / "manifest.json"
    data = json.loads(manifest.read_text())
    data["schema_version"] = 99
    manifest.write_text(json.dumps(data))
    rc, _, err = run_cli(
        capsys, "artifacts", "--config", str(path), "show", expert.id, "--rows", "1"
    )
    assert_one_line_error(rc, err, "schema mismatch", "v99")


# -- the read-only commands ---------------------------------------------------------------------


def test_artifacts_ls_show_lineage(small_store, capsys):
    path, store, (tasks, val, test), expert = small_store
    rc, out, err = run_cli(capsys, "artifacts", "--config", str(path), "ls")
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert len(lines) == 4
    # ordered by creation time, which has one-second resolution: look lines up by id
    by_id = {line.split()[4]: line for line in lines}
    assert set(by_id) == {tasks.id, val.id, test.id, expert.id}
    assert by_id[tasks.id].split()[:4] == ["round", "0", "tasks", "tasks"]
    assert "rows=24" in by_id[tasks.id] and "rows=8" in by_id[test.id]
    assert by_id[expert.id].split()[:4] == ["round", "0", "expert", "trajectories"]
    assert "rows=32" in by_id[expert.id]  # 24 train demonstrations + 8 val
    # Each line ends with how long its stage took (the manifest's ``seconds``, as m:ss).
    took = f"took {duration(expert.manifest['seconds'])}"
    assert by_id[expert.id].endswith(took)
    rc, out, _ = run_cli(capsys, "artifacts", "--config", str(path), "ls", "--stage", "expert")
    assert rc == 0 and out.splitlines() == [by_id[expert.id]]
    rc, out, _ = run_cli(capsys, "artifacts", "--config", str(path), "ls", "--round", "1")
    assert rc == 0 and out == ""

    rc, out, _ = run_cli(
        capsys, "artifacts", "--config", str(path), "show", expert.id, "--rows", "2"
    )
    assert rc == 0
    manifest_text, _, rows_text = out.partition("\n}\n")
    manifest = json.loads(manifest_text + "\n}")
    assert (
        manifest["id"] == expert.id
        and manifest["rows"] == 32
        and manifest["inputs"] == [tasks.id, val.id]
    )
    assert len(rows_text.strip().splitlines()) == 3  # header + 2 rows
    assert "expert" in rows_text

    rc, out, _ = run_cli(capsys, "artifacts", "--config", str(path), "lineage", expert.id)
    assert rc == 0
    lines = out.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith(expert.id) and "[trajectories, round 0]" in lines[0]
    assert "arith/oracle_success=" in lines[0]
    assert lines[1].startswith("  " + tasks.id) and "[tasks, round 0]" in lines[1]
    assert lines[2].startswith("  " + val.id)


def test_reading_commands_take_overrides(small_store, capsys):
    # run.name=... reads another run's store with the same config; that one is empty here.
    path, store, _, expert = small_store
    rc, out, _ = run_cli(capsys, "artifacts", "--config", str(path), "ls", "run.name=other")
    assert (rc, out) == (0, "")
    rc, out, _ = run_cli(capsys, "report", "--json", "--config", str(path), "run.name=other")
    assert (rc, json.loads(out)) == (0, [])
    rc, _, err = run_cli(capsys, "show", expert.id, "--config", str(path), "run.name=other")
    assert rc == 2 and f"no artifact {expert.id} in " in err and err.strip().endswith("/other")
    rc, out, _ = run_cli(capsys, "artifacts", "--config", str(path), "show", expert.id)
    assert rc == 0 and expert.id in out  # the config's own run still has it
    rc, _, err = run_cli(capsys, "artifacts", "--config", str(path), "lineage", expert.id, "x.y=1")
    assert_one_line_error(rc, err, "unknown key x")


def test_config_fields_and_dump(tmp_path, capsys):
    rc, out, err = run_cli(capsys, "config", "--fields")
    assert rc == 0 and err == ""
    keys = [line.split()[0] for line in out.splitlines()]
    assert keys == [k for k, _ in field_help()]
    assert {"sft.lr", "explore.samples_per_task", "envs.<name>.n_train", "tracking.uri"} <= set(
        keys
    )
    assert all(len(line.split(None, 1)) == 2 for line in out.splitlines()), (
        "a field has no help text"
    )
    path = write_tiny_yaml(tmp_path)
    rc, out, _ = run_cli(capsys, "config", "--config", str(path), "sft.lr=0.5")
    assert rc == 0
    dumped = load_config(None).model_validate(yaml.safe_load(out))
    assert dumped.sft.lr == 0.5 and dumped.envs[0].n_train == 24


def test_artifacts_ls_ends_with_the_writes_in_progress(small_store, capsys):
    path, store, _, expert = small_store
    w = store.writer("checkpoints", stage="sft", round=0, config={"unfinished": 1}, inputs=[])
    store.fs.makedirs(f"{w.tmp_dir}/_train_state/step500", exist_ok=True)
    store.fs.pipe_file(f"{w.tmp_dir}/_train_state/latest", b"step500")
    rc, out, err = run_cli(capsys, "artifacts", "--config", str(path), "ls")
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert len(lines) == 5  # the four artifacts, then the write in progress
    assert lines[-1].split()[:5] == ["round", "0", "sft", "unfinished", w.id]
    assert "train state at step 500, last write 20" in lines[-1]
    assert lines[-1].endswith("(running, or stopped: a rerun resumes from it)")
    rc, out, _ = run_cli(capsys, "artifacts", "--config", str(path), "ls", "--stage", "expert")
    assert rc == 0 and out.splitlines() == [line for line in lines if expert.id in line]


def test_artifacts_ls_says_what_an_unfinished_write_holds():
    from datetime import UTC, datetime

    from flywheel.cli import _progress
    from flywheel.store import Unfinished

    at = datetime(2026, 11, 29, 13, 5, 49, tzinfo=UTC)
    u = Unfinished("explore-x", "explore", 1, "/s/.tmp-explore-x", 3, None, at)
    assert _progress(u) == (
        "3 shards written, last write 2026-11-29 13:05 UTC (running, or stopped: a rerun keeps them)"
    )
    one = dataclasses.replace(u, shards=1, modified=None)
    assert _progress(one) == "1 shard written (running, or stopped: a rerun keeps it)"
    assert _progress(dataclasses.replace(u, shards=0)).startswith("no train state or shard yet, ")
    assert _progress(dataclasses.replace(u, shards=0)).endswith("a rerun starts it over)")
    # a training stage: the train state's step, not the shards
    assert _progress(dataclasses.replace(u, train_step=500)).startswith("train state at step 500,")


def test_artifacts_ls_says_a_stage_resumed_and_that_old_manifests_were_not_timed():
    from flywheel.cli import _took

    assert _took({"seconds": 3861.8, "resumed": True}) == "  took 1:04:22 (resumed)"
    assert _took({"seconds": 7.0, "resumed": False}) == "  took 0:07"
    assert _took({"created": "2026-11-28T10:00:00"}) == ""
