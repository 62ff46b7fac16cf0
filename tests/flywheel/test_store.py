import json
import os
import platform
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_contracts import SchemaError
from flywheel.store import (
    KERNEL_ENV,
    TRAIN_STATE_DIR,
    ArtifactError,
    Store,
    host_label,
    read_parquet,
    rerun_reason,
)


def task_rows(n, split="train"):
    return [
        {
            "task_id": f"t-{split}-{i}",
            "env": "arith",
            "split": split,
            "seed": i,
            "difficulty": 1,
            "prompt": f"what is {i} + 1?",
            "answer": str(i + 1),
            "meta": "{}",
        }
        for i in range(n)
    ]


def write_tasks(store, n=5, config=None, force=False, inputs=()):
    w = store.writer(
        "tasks", stage="tasks", round=0, config=config or {"n": n}, inputs=list(inputs), force=force
    )
    if w.cached:
        return w.ref, True
    w.write_shard(0, task_rows(n))
    return w.commit(summary={"n": n}), False


def test_write_then_read_roundtrip(tmp_path):
    store = Store(str(tmp_path), run="r")
    ref, cached = write_tasks(store)
    assert not cached
    table = store.read(ref)
    assert table.num_rows == 5
    assert table.column("answer").to_pylist() == [str(i + 1) for i in range(5)]
    assert ref.manifest["rows"] == 5 and ref.manifest["kind"] == "tasks"
    assert (tmp_path / "r" / "round-0" / "tasks" / ref.id / "manifest.json").exists()
    # no temporary folder is left behind
    assert not [
        p for p in (tmp_path / "r" / "round-0" / "tasks").iterdir() if p.name.startswith(".tmp")
    ]


def test_manifest_records_the_machine_that_wrote_it(tmp_path):
    """``host``: the CPU from /proc/cpuinfo (and its kernel flags), with torch loaded also the
    kernels torch picked and its threads; the id does not depend on it."""
    import torch

    store = Store(str(tmp_path), run="r")
    ref, _ = write_tasks(store)
    host = ref.manifest["host"]
    with open("/proc/cpuinfo") as fh:
        fields = [ln.split(":", 1) for ln in fh.read().splitlines() if ":" in ln]
    names = [v.strip() for k, v in fields if k.strip() == "model name"]
    flags = next((set(v.split()) for k, v in fields if k.strip() == "flags"), set())
    # aarch64 lists neither a model name nor x86 flags: the platform's name, and no flags
    name = names[0] if names else platform.processor() or platform.machine()
    assert host["cpu"] == name and host["cores"] == os.cpu_count()
    assert host["cpu_flags"] == [
        f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags
    ]
    assert host["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert host["threads"] == torch.get_num_threads() and host["torch"] == torch.__version__
    assert "kernel_env" not in host or set(host["kernel_env"]) <= set(KERNEL_ENV)
    other = Store(str(tmp_path / "other"), run="r")
    assert write_tasks(other)[0].id == ref.id


def test_manifest_records_kernel_pins_and_the_label_shows_them(tmp_path, monkeypatch):
    """A pin of torch's CPU kernels set in the environment goes into ``host`` and its label."""
    for key in KERNEL_ENV:
        monkeypatch.delenv(key, raising=False)
    store = Store(str(tmp_path), run="r")
    assert "kernel_env" not in write_tasks(store)[0].manifest["host"]
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    host = write_tasks(store, force=True)[0].manifest["host"]
    assert host["kernel_env"] == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}
    assert "ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2" in host_label(host)


def test_same_config_is_cache_hit_and_force_makes_new_version(tmp_path):
    store = Store(str(tmp_path))
    ref1, _ = write_tasks(store)
    ref2, cached = write_tasks(store)
    assert cached and ref2.id == ref1.id
    ref3, cached = write_tasks(store, force=True)
    assert not cached and ref3.id == ref1.id + ".2"
    ref4, cached = write_tasks(store)
    assert cached and ref4.id == ref3.id  # the newest version wins
    ref5, cached = write_tasks(store, config={"n": 6}, n=6)
    assert not cached and ref5.id != ref1.id


def test_inputs_change_the_id(tmp_path):
    store = Store(str(tmp_path))
    a, _ = write_tasks(store, inputs=["x-1"])
    b, _ = write_tasks(store, inputs=["x-2"])
    assert a.id != b.id


def test_rerun_reason_names_the_config_keys_that_changed(tmp_path):
    """A stage that was computed, not found, says which config keys set it apart from the
    nearest earlier artifact of its stage made from the same inputs; nothing for new inputs or a
    first run; a forced version of the same config, or a sibling this process wrote, is not a
    reason."""
    earlier = Store(str(tmp_path))
    base = {"model": {"tiny": {"hidden_size": 64}, "base": None}, "seed": 1}
    first, _ = write_tasks(earlier, config=base, inputs=["expert-1"])
    assert rerun_reason(earlier, first) is None  # nothing else of its stage
    again, _ = write_tasks(earlier, config=base, inputs=["expert-1"], force=True)
    assert rerun_reason(earlier, again) is None  # the same config, written again
    far = {"seed": 9, "lr": 1, "steps": 2}
    write_tasks(earlier, config=far, inputs=["expert-1"])
    # A later process (a new Store): what this one wrote was an earlier run's.
    store = Store(str(tmp_path))
    wider = {"model": {"tiny": {"hidden_size": 128}, "base": None}, "seed": 1, "noops": ["x"]}
    changed, _ = write_tasks(store, config=wider, inputs=["expert-1"])
    # the nearest: ``again`` (2 keys apart), not the newer ``far`` (5 apart)
    assert rerun_reason(store, changed) == (
        f"same inputs as {again.id}; config differs in model.tiny.hidden_size, noops"
    )
    sibling, _ = write_tasks(store, config={**wider, "split": "test"}, inputs=["expert-1"])
    # ``changed`` (1 key apart) was written by this process: ``again`` is the nearest earlier one
    assert rerun_reason(store, sibling) == (
        f"same inputs as {again.id}; config differs in model.tiny.hidden_size, noops, split"
    )
    broken = tmp_path / "default" / "round-0" / "tasks" / "tasks-000000000000"
    broken.mkdir()
    (broken / "manifest.json").write_text("{not json")
    assert rerun_reason(store, changed) is not None  # a corrupted manifest is passed over
    # A list of named sections (the envs) is read by name: the key says which env changed.
    envs = [{"name": "arith", "n_test": 8}, {"name": "craft", "n_test": 8}]
    write_tasks(store, config={"envs": envs}, inputs=["env-1"])
    moved = [envs[0], {"name": "craft", "n_test": 9}]
    next_run = Store(str(tmp_path))
    later, _ = write_tasks(next_run, config={"envs": moved}, inputs=["env-1"])
    assert rerun_reason(next_run, later).endswith("config differs in envs.craft.n_test")
    elsewhere, _ = write_tasks(store, config={"seed": 2}, inputs=["expert-2"])
    assert rerun_reason(store, elsewhere) is None  # new inputs say why by themselves
    many = {f"k{i}": i for i in range(7)}
    last, _ = write_tasks(Store(str(tmp_path)), config=many, inputs=["expert-1"])
    # nearest earlier: ``again``, the newest version of ``base`` (its 2 keys and the 7 new ones;
    # ``far`` is 10 apart); two shown
    assert rerun_reason(store, last, shown=2) == (
        f"same inputs as {again.id}; config differs in k0, k1 and 7 more"
    )


def test_schema_mismatch_on_write_names_column(tmp_path):
    store = Store(str(tmp_path))
    w = store.writer("tasks", stage="tasks", round=0, config={}, inputs=[])
    rows = task_rows(2)
    rows[1]["difficulty"] = "hard"
    with pytest.raises(SchemaError, match="schema mismatch"):
        w.write_shard(0, rows)
    rows = task_rows(2)
    del rows[0]["prompt"]
    with pytest.raises(SchemaError, match="'prompt'"):
        w.write_shard(0, rows)


def test_schema_mismatch_on_read_names_file_and_column(tmp_path):
    store = Store(str(tmp_path))
    ref, _ = write_tasks(store)
    shard = tmp_path / "default" / "round-0" / "tasks" / ref.id / "part-00000.parquet"
    table = pq.read_table(shard)
    table = table.set_column(table.schema.get_field_index("seed"), "seed", pa.array(["x"] * 5))
    pq.write_table(table, shard)
    with pytest.raises(
        SchemaError, match=r"part-00000.parquet: column 'seed' has type string, expected int64"
    ):
        store.read(ref)


def test_missing_and_corrupted_artifacts(tmp_path):
    store = Store(str(tmp_path))
    with pytest.raises(ArtifactError, match="no artifact tasks-nope"):
        store.get("tasks-nope")
    ref, _ = write_tasks(store)
    folder = tmp_path / "default" / "round-0" / "tasks" / ref.id
    (folder / "part-00000.parquet").write_bytes(b"not parquet")
    with pytest.raises(ArtifactError, match="corrupted shard"):
        store.read(ref.id)
    (folder / "part-00000.parquet").unlink()
    with pytest.raises(ArtifactError, match="missing shard"):
        store.read(ref.id)
    (folder / "manifest.json").write_text("{broken")
    with pytest.raises(ArtifactError, match="corrupted manifest"):
        store.get(ref.id)


def test_unfinished_writer_is_invisible_and_resumes(tmp_path):
    store = Store(str(tmp_path))
    w = store.writer("tasks", stage="tasks", round=0, config={"k": 1}, inputs=[])
    w.write_shard(0, task_rows(3))
    assert store.list() == []  # no manifest yet: readers see nothing
    w2 = store.writer("tasks", stage="tasks", round=0, config={"k": 1}, inputs=[])
    assert w2.id == w.id and w2.has_shard(0) and not w2.has_shard(1)
    w2.write_shard(1, task_rows(2, split="test"))
    ref = w2.commit()
    assert store.read(ref).num_rows == 5


def test_manifest_times_the_stage_and_says_when_it_resumed(tmp_path, monkeypatch):
    # time.monotonic at each writer's opening (the cache hit's last) and at each commit
    clock = iter([100.0, 104.25, 150.0, 200.0, 230.0, *range(240, 300, 10), 300.0])
    monkeypatch.setattr("flywheel.store.time.monotonic", lambda: next(clock))
    store = Store(str(tmp_path))
    w = store.writer("tasks", stage="tasks", round=0, config={"k": 1}, inputs=[])
    w.write_shard(0, task_rows(3))
    m = w.commit().manifest
    assert (m["seconds"], m["resumed"]) == (4.2, False)  # 4.25 s to one decimal
    assert m["started"] <= m["created"]
    # An interrupted run leaves a finished shard; the run that takes it over says so, and
    # counts only its own time.
    crashed = store.writer("tasks", stage="tasks", round=0, config={"k": 2}, inputs=[])
    crashed.write_shard(0, task_rows(3))
    w2 = store.writer("tasks", stage="tasks", round=0, config={"k": 2}, inputs=[])
    w2.write_shard(1, task_rows(2, split="test"))
    m2 = w2.commit().manifest
    assert (m2["seconds"], m2["resumed"]) == (30.0, True)
    # Only shards or a saved train state count as taken over: a folder left holding the best
    # weights so far and a half-written shard starts over, and says so.
    crashed = store.writer("tasks", stage="tasks", round=0, config={"k": 3}, inputs=[])
    store.fs.makedirs(f"{crashed.tmp_dir}/_best", exist_ok=True)
    store.fs.pipe_file(f"{crashed.tmp_dir}/{crashed.shard_name(0)}.part", b"PAR1 half")
    w3 = store.writer("tasks", stage="tasks", round=0, config={"k": 3}, inputs=[])
    w3.write_shard(0, task_rows(1))
    assert w3.commit().manifest["resumed"] is False
    # A training stage's saved train state (flywheel/training/loop.py) does count.
    crashed = store.writer("tasks", stage="tasks", round=0, config={"k": 4}, inputs=[])
    store.fs.makedirs(f"{crashed.tmp_dir}/{TRAIN_STATE_DIR}/step40", exist_ok=True)
    store.fs.pipe_file(f"{crashed.tmp_dir}/{TRAIN_STATE_DIR}/latest", b"step40")
    w4 = store.writer("tasks", stage="tasks", round=0, config={"k": 4}, inputs=[])
    w4.write_shard(0, task_rows(1))
    assert w4.commit().manifest["resumed"] is True
    # A cache hit keeps the manifest it had.
    assert (
        store.writer("tasks", stage="tasks", round=0, config={"k": 1}, inputs=[]).ref.manifest == m
    )


def test_unfinished_lists_writes_in_progress_with_what_they_hold(tmp_path, monkeypatch):
    store = Store(str(tmp_path))
    assert store.unfinished() == []
    rollout = store.writer("tasks", stage="explore", round=1, config={"k": 1}, inputs=[])
    rollout.write_shard(0, task_rows(3))
    rollout.write_shard(3, task_rows(2))
    training = store.writer("checkpoints", stage="sft", round=2, config={"k": 1}, inputs=[])
    # A local store's training stage keeps its train state in the .tmp folder.
    store.fs.makedirs(f"{training.tmp_dir}/_train_state/step40", exist_ok=True)
    store.fs.pipe_file(f"{training.tmp_dir}/_train_state/latest", b"step40")
    empty = store.writer("tasks", stage="tasks", round=0, config={"k": 1}, inputs=[])
    found = store.unfinished()
    assert [(u.round, u.stage, u.id) for u in found] == [
        (0, "tasks", empty.id), (1, "explore", rollout.id), (2, "sft", training.id)
    ]  # fmt: skip
    assert [(u.shards, u.train_step) for u in found] == [(0, None), (2, None), (0, 40)]
    assert all(u.modified is not None and u.modified.tzinfo is not None for u in found)
    assert found[1].path == rollout.tmp_dir
    assert [u.id for u in store.unfinished(round=1)] == [rollout.id]
    assert [u.id for u in store.unfinished(stage="sft")] == [training.id]
    # A commit turns the write into an artifact: no longer unfinished.
    rollout.commit()
    assert [u.id for u in store.unfinished()] == [empty.id, training.id]
    assert [r.id for r in store.list()] == [rollout.id]
    # A write committed (renamed into place) between the listing and the look inside is skipped.
    real_ls = store.fs.ls

    def ls_after_commit(path, **kw):
        if path.endswith(training.tmp_dir.rsplit("/", 1)[-1]):
            raise FileNotFoundError(path)
        return real_ls(path, **kw)

    monkeypatch.setattr(store.fs, "ls", ls_after_commit)
    assert [u.id for u in store.unfinished()] == [empty.id]
    monkeypatch.undo()
    # An object store says when its files were written too (here fsspec's memory filesystem).
    remote = Store("memory://flywheel-unfinished", run="m")
    w = remote.writer("tasks", stage="explore", round=1, config={}, inputs=[])
    w.write_shard(0, task_rows(2))
    (u,) = remote.unfinished()
    assert (u.id, u.shards, u.path) == (w.id, 1, f"memory://{w.tmp_dir}")
    assert u.modified is not None


def test_partial_shard_file_is_not_a_finished_shard(tmp_path):
    store = Store(str(tmp_path))
    w = store.writer("tasks", stage="tasks", round=0, config={}, inputs=[])
    # a crash in the middle of a shard write leaves only the .part file
    with open(f"{w.tmp_dir}/{w.shard_name(0)}.part", "wb") as fh:
        fh.write(b"PAR1 half")
    assert not w.has_shard(0)
    assert w.finished_shards() == []


def test_fsspec_memory_store_and_lineage():
    store = Store("memory://flywheel-test", run="m")
    a, _ = write_tasks(store, config={"a": 1})
    w = store.writer("tasks", stage="expert", round=0, config={}, inputs=[a.id])
    w.write_shard(0, task_rows(1))
    b = w.commit()
    assert store.read(b.id).num_rows == 1
    tree = store.lineage(b.id)
    assert tree["inputs"][0]["id"] == a.id
    assert {r.id for r in store.list()} == {a.id, b.id}
    assert store.local_path(b).joinpath("manifest.json").exists()


def test_ancestors_lists_a_shared_input_once_and_names_a_missing_one(tmp_path):
    # A diamond: b and c are made from a, d from both; a is one ancestor of d, not two.
    store = Store(str(tmp_path), run="d")
    a, _ = write_tasks(store, config={"a": 1})
    refs = {}
    for name, inputs in [("b", [a.id]), ("c", [a.id]), ("d", None)]:
        inputs = inputs or [refs["b"].id, refs["c"].id]
        w = store.writer("tasks", stage="expert", round=0, config={"n": name}, inputs=inputs)
        w.write_shard(0, task_rows(1))
        refs[name] = w.commit()
    found = [r.id for r in store.ancestors([refs["d"].id])]
    assert sorted(found) == sorted([a.id, refs["b"].id, refs["c"].id, refs["d"].id])
    assert [r.id for r in store.ancestors([a.id, a.id])] == [a.id]
    # An input whose artifact is gone: an error naming it, or left out when asked.
    w = store.writer("tasks", stage="expert", round=0, config={"n": "e"}, inputs=["tasks-gone"])
    w.write_shard(0, task_rows(1))
    e = w.commit()
    with pytest.raises(ArtifactError, match="tasks-gone"):
        store.ancestors([e.id])
    assert [r.id for r in store.ancestors([e.id], skip_missing=True)] == [e.id]


def test_sigkill_during_write_never_exposes_partial_artifact(tmp_path):
    # A child writes shards slowly and is killed; the parent sees no artifact, then resumes.
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {os.getcwd()!r})
        from flywheel.store import Store
        from tests.flywheel.test_store import task_rows
        store = Store({str(tmp_path)!r})
        w = store.writer("tasks", stage="tasks", round=0, config={{"slow": 1}}, inputs=[])
        for i in range(5):
            if not w.has_shard(i):
                w.write_shard(i, task_rows(4))
            if i == 2 and len(sys.argv) > 1:
                os.kill(os.getpid(), signal.SIGKILL)
        ref = w.commit()
        print(ref.manifest["rows"])
        """
    )
    killed = subprocess.run([sys.executable, "-c", script, "kill"], capture_output=True, text=True)
    assert killed.returncode == -9
    store = Store(str(tmp_path))
    assert store.list() == []
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "20"
    ref = store.list()[0]
    assert json.loads(
        (tmp_path / "default" / "round-0" / "tasks" / ref.id / "manifest.json").read_text()
    )["shards"] == [f"part-0000{i}.parquet" for i in range(5)]


def test_read_parquet_leaves_no_python_object_to_arrow(tmp_path):
    """pyarrow given a Python file could free its reader, and the file with it, on a pool thread
    after read_table returned; at interpreter exit that thread then aborted the process (exit
    134). read_parquet hands Arrow a copy in its own memory: once it returns, the file is
    referenced only by its caller, every time (with ``pq.read_table(fh)`` one read in about
    five still held it here)."""
    store = Store(str(tmp_path), run="r")
    ref, _ = write_tasks(store, n=200)
    shard = tmp_path / "r" / "round-0" / "tasks" / ref.id / "part-00000.parquet"
    held = []
    for _ in range(50):
        with open(shard, "rb") as fh:
            before = sys.getrefcount(fh)
            table = read_parquet(fh, columns=["task_id", "answer"])
            held.append(sys.getrefcount(fh) - before)
    assert held == [0] * 50
    assert table.column("answer").to_pylist() == [str(i + 1) for i in range(200)]
