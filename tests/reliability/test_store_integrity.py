"""What the store commits and what it lists, under leftovers and damage: a commit takes only the
shards that prove (by their footer) that they belong to the artifact and index; a folder without
a manifest and a corrupted manifest are reported, never skipped silently; ``force`` replaces a
corrupted artifact; lineage cycles and glob-like ids are one-line errors.

    .venv/bin/python -m pytest tests/reliability/test_store_integrity.py
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_contracts import CONTRACTS
from flywheel.cli import main
from flywheel.config import dump_config, load_config
from flywheel.store import ArtifactError, Store


def rows(n: int, tag: str = "t") -> list[dict]:
    return [
        {
            "task_id": f"{tag}-{i}",
            "env": "arith",
            "split": "train",
            "seed": i,
            "difficulty": 1,
            "prompt": f"{tag}: what is {i} + 1?",
            "answer": str(i + 1),
            "meta": "{}",
        }
        for i in range(n)
    ]


def writer(store: Store, config: dict | None = None, force: bool = False, stage: str = "tasks"):
    return store.writer(
        "tasks", stage=stage, round=0, config=config or {"k": 1}, inputs=[], force=force
    )


def commit(store: Store, n: int = 3, config: dict | None = None, tag: str = "t"):
    w = writer(store, config)
    w.write_shard(0, rows(n, tag))
    return w.commit()


def crashed_shards(store: Store, config: dict, n_shards: int, tag: str = "old") -> Path:
    """A writer that wrote shards and never committed: its .tmp folder is what is left."""
    w = writer(store, config)
    for i in range(n_shards):
        w.write_shard(i, rows(2, f"{tag}{i}"))
    return Path(w.tmp_dir)


def ids_in(store: Store, ref) -> list[str]:
    return store.read(ref).column("task_id").to_pylist()


# -- what a commit takes from the .tmp folder ----------------------------------------------------


def test_part_file_is_ignored_and_not_committed(tmp_path):
    store = Store(str(tmp_path))
    w = writer(store)
    Path(w.tmp_dir, "part-00001.parquet.part").write_bytes(b"PAR1 half a shard")
    w.write_shard(0, rows(2))
    assert w.finished_shards() == [0] and not w.has_shard(1)
    ref = w.commit()
    assert ref.manifest["shards"] == ["part-00000.parquet"] and ref.manifest["rows"] == 2
    assert sorted(p.name for p in Path(ref.path).iterdir()) == ["manifest.json", w.shard_name(0)]


def test_shard_of_another_artifact_at_an_index_this_run_writes_is_rewritten(tmp_path):
    store = Store(str(tmp_path))
    foreign = crashed_shards(store, {"other": 1}, 1, tag="foreign")
    w = writer(store, {"mine": 1})
    shutil.copy(foreign / w.shard_name(0), Path(w.tmp_dir) / w.shard_name(0))
    assert not w.has_shard(0)  # the footer names the other artifact
    w.write_shard(0, rows(2, "mine"))
    assert ids_in(store, w.commit()) == ["mine-0", "mine-1"]


def test_shard_of_another_artifact_at_an_extra_index_is_not_committed(tmp_path):
    store = Store(str(tmp_path))
    foreign = crashed_shards(store, {"other": 1}, 1)
    w = writer(store, {"mine": 1})
    shutil.copy(foreign / w.shard_name(0), Path(w.tmp_dir) / w.shard_name(7))
    w.write_shard(0, rows(3, "mine"))
    assert w.finished_shards() == [0]
    ref = w.commit()
    assert ref.manifest["shards"] == [w.shard_name(0)] and ref.manifest["rows"] == 3
    assert not Path(ref.path, w.shard_name(7)).exists()
    assert ids_in(store, ref) == ["mine-0", "mine-1", "mine-2"]


def test_shard_moved_to_another_index_is_not_finished(tmp_path):
    store = Store(str(tmp_path))
    tmp = crashed_shards(store, {"k": 1}, 1)
    (tmp / "part-00000.parquet").rename(tmp / "part-00003.parquet")
    w = writer(store, {"k": 1})
    assert w.finished_shards() == []
    w.write_shard(0, rows(1, "new"))
    ref = w.commit()
    assert ref.manifest["rows"] == 1 and ids_in(store, ref) == ["new-0"]


@pytest.mark.parametrize(
    "content",
    [b"not parquet at all", b"PAR1" + b"\0" * 64 + b"PAR1", b""],
    ids=["garbage", "bad-footer", "empty"],
)
def test_unreadable_shard_is_not_finished_nor_committed(tmp_path, content):
    store = Store(str(tmp_path))
    w = writer(store)
    Path(w.tmp_dir, w.shard_name(0)).write_bytes(content)
    Path(w.tmp_dir, w.shard_name(1)).write_bytes(content)
    assert w.finished_shards() == []
    w.write_shard(0, rows(2))
    ref = w.commit()
    assert ref.manifest["shards"] == [w.shard_name(0)]
    assert not Path(ref.path, w.shard_name(1)).exists()


def test_unstamped_shard_is_not_finished(tmp_path):
    # a valid shard of the right shape but without the footer stamp (an older writer, a copy)
    store = Store(str(tmp_path))
    w = writer(store)
    table = pa.Table.from_pylist(rows(2, "stale"), schema=CONTRACTS["tasks"].schema)
    pq.write_table(table, Path(w.tmp_dir, w.shard_name(0)))
    assert not w.has_shard(0)
    w.write_shard(0, rows(2, "fresh"))
    assert ids_in(store, w.commit()) == ["fresh-0", "fresh-1"]


def test_stamped_shard_with_another_schema_is_not_finished(tmp_path):
    store = Store(str(tmp_path))
    w = writer(store)
    stamp = {b"flywheel.artifact": w.id.encode(), b"flywheel.shard": b"0"}
    table = pa.table({"task_id": ["x"]}).replace_schema_metadata(stamp)
    pq.write_table(table, Path(w.tmp_dir, w.shard_name(0)))
    assert not w.has_shard(0)
    assert w.commit().manifest["rows"] == 0


def test_crashed_run_of_the_same_artifact_resumes(tmp_path):
    store = Store(str(tmp_path))
    crashed_shards(store, {"k": 1}, 2, tag="first")
    w = writer(Store(str(tmp_path)), {"k": 1})  # a new process
    assert w.finished_shards() == [0, 1] and w.has_shard(1) and not w.has_shard(2)
    w.write_shard(2, rows(1, "second"))
    ref = w.commit()
    assert ref.manifest["rows"] == 5
    assert ids_in(store, ref) == ["first0-0", "first0-1", "first1-0", "first1-1", "second-0"]


def test_read_drops_the_footer_stamp(tmp_path):
    store = Store(str(tmp_path))
    ref = commit(store)
    assert store.read(ref).schema.metadata == CONTRACTS["tasks"].schema.metadata
    w = writer(store, {"other": 2})
    w.write_shard(0, rows(1))
    assert w.read_shards().schema.metadata == CONTRACTS["tasks"].schema.metadata


def test_memory_store_commits_only_verified_shards():
    store = Store(f"memory://integrity-{uuid.uuid4().hex}", run="m")
    w = writer(store, {"mem": 1})
    with store.fs.open(f"{w.tmp_dir}/{w.shard_name(4)}", "wb") as fh:
        fh.write(b"junk")
    with store.fs.open(f"{w.tmp_dir}/{w.shard_name(0)}.part", "wb") as fh:
        fh.write(b"half")
    w.write_shard(0, rows(2))
    ref = w.commit()
    assert ref.manifest["shards"] == [w.shard_name(0)]
    folder = store.fs._strip_protocol(ref.path)
    left = {p.rsplit("/", 1)[-1] for p in store.fs.ls(folder, detail=False)}
    assert left == {"manifest.json", w.shard_name(0)}
    store.fs.rm(store.base, recursive=True)


# -- folders without a manifest, corrupted manifests ---------------------------------------------


def test_folder_without_manifest_is_reported_and_replaced(tmp_path):
    store = Store(str(tmp_path))
    ref = commit(store)
    Path(ref.path, "manifest.json").unlink()
    assert store.list() == []
    refs, problems = store.scan()
    assert refs == [] and len(problems) == 1
    assert problems[0].startswith(f"incomplete artifact {ref.path}: no manifest.json")
    with pytest.raises(ArtifactError, match=f"artifact {ref.id} is incomplete"):
        store.get(ref.id)
    again = commit(store, n=4)  # the same id: the leftover folder is replaced
    assert again.id == ref.id and store.read(again).num_rows == 4
    assert store.scan() == ([again], [])


def test_corrupted_manifest_needs_force_which_replaces_it(tmp_path):
    store = Store(str(tmp_path))
    ref = commit(store)
    Path(ref.path, "manifest.json").write_text("{broken")
    with pytest.raises(ArtifactError, match="corrupted manifest .*force a new version"):
        writer(store)
    w = writer(store, force=True)
    assert w.id == ref.id and w.cached is None  # written in place of the unreadable one
    w.write_shard(0, rows(5))
    fixed = w.commit()
    assert store.read(fixed).num_rows == 5 and [r.id for r in store.list()] == [ref.id]


def test_force_over_a_corrupted_newer_version(tmp_path):
    store = Store(str(tmp_path))
    first = commit(store)
    w = writer(store, force=True)
    w.write_shard(0, rows(2))
    second = w.commit()
    assert second.id == f"{first.id}.2"
    Path(second.path, "manifest.json").write_text("[]")
    with pytest.raises(ArtifactError, match=f"{second.id}.*force"):
        writer(store)
    again = writer(store, force=True)
    assert again.id == second.id
    again.write_shard(0, rows(1))
    again.commit()
    assert [r.id for r in store.list()] == [first.id, second.id]


def test_newer_folder_without_manifest_does_not_shadow_the_artifact(tmp_path):
    store = Store(str(tmp_path))
    first = commit(store)
    Path(first.path).with_name(f"{first.id}.2").mkdir()  # an interrupted commit of version 2
    assert writer(store).cached == first
    w = writer(store, force=True)
    assert w.id == f"{first.id}.2"
    w.write_shard(0, rows(1))
    assert w.commit().manifest["rows"] == 1


def test_scan_leaves_out_unfinished_writes(tmp_path):
    store = Store(str(tmp_path))
    ref = commit(store)
    crashed_shards(store, {"later": 1}, 1)
    assert store.scan() == ([ref], [])


# -- artifacts ls / show / lineage through the CLI -----------------------------------------------


@pytest.fixture
def cli_store(tmp_path):
    """Three artifacts (tasks, expert, evaluate stages) and a YAML config that points at them."""
    cfg_path = tmp_path / "c.yaml"
    cfg = load_config(None, [f"run.store={tmp_path / 'store'}", "run.name=r"])
    cfg_path.write_text(dump_config(cfg))
    store = Store(cfg.run.store_root(), cfg.run.name)
    refs = [commit(store, n=i + 1, config={"i": i}, tag=s) for i, s in enumerate(("a", "b", "c"))]
    return cfg_path, store, refs


def ls(capsys, cfg_path) -> tuple[int, list[str], list[str]]:
    capsys.readouterr()
    rc = main(["artifacts", "--config", str(cfg_path), "ls"])
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err.splitlines()


def test_ls_lists_what_it_can_and_names_what_it_cannot(cli_store, capsys):
    cfg_path, _, (a, b, c) = cli_store
    Path(a.path, "manifest.json").write_text("{")
    Path(b.path, "manifest.json").unlink()
    rc, out, err = ls(capsys, cfg_path)
    assert rc == 0
    assert len(out) == 1 and c.id in out[0]
    assert len(err) == 2 and all(line.startswith("flywheel: warning: ") for line in err)
    assert any("corrupted manifest" in line and a.id in line for line in err)
    assert any("incomplete artifact" in line and b.id in line for line in err)


def test_ls_fails_only_when_nothing_could_be_listed(cli_store, capsys):
    cfg_path, _, refs = cli_store
    for ref in refs:
        Path(ref.path, "manifest.json").write_text("not json")
    rc, out, err = ls(capsys, cfg_path)
    assert rc == 2 and out == []
    assert len(err) == 3 and all(line.startswith("flywheel: error: corrupted") for line in err)


def test_ls_of_an_empty_store_is_empty_and_fine(tmp_path, capsys):
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(f"run:\n  store: {tmp_path / 'nothing'}\n")
    assert ls(capsys, cfg_path) == (0, [], [])


def test_lineage_cycle_is_one_line(cli_store, capsys):
    cfg_path, store, (a, b, c) = cli_store
    for ref, inputs in ((a, [b.id]), (b, [c.id]), (c, [a.id])):
        manifest = Path(ref.path, "manifest.json")
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "inputs": inputs}))
    with pytest.raises(ArtifactError, match=f"lineage cycle: {a.id} -> {b.id} -> {c.id} -> {a.id}"):
        store.lineage(a.id)
    capsys.readouterr()
    assert main(["artifacts", "--config", str(cfg_path), "lineage", b.id]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "lineage cycle" in err


def test_lineage_of_itself_and_bad_inputs(cli_store):
    _, store, (a, b, _) = cli_store
    manifest = Path(a.path, "manifest.json")
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**data, "inputs": [a.id]}))
    with pytest.raises(ArtifactError, match=f"lineage cycle: {a.id} -> {a.id}"):
        store.lineage(a.id)
    manifest.write_text(json.dumps({**data, "inputs": "oops"}))
    with pytest.raises(ArtifactError, match="inputs is not a list"):
        store.lineage(a.id)
    manifest.write_text(json.dumps({**data, "inputs": ["tasks-000000000000"]}))
    with pytest.raises(ArtifactError, match="no artifact tasks-000000000000"):
        store.lineage(a.id)
    assert store.lineage(b.id)["inputs"] == []  # a diamond or a clean chain is no cycle


# -- names that are not plain --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".", "..", "*", "a?"])
def test_run_names_and_ids_must_be_plain(tmp_path, name):
    with pytest.raises(ArtifactError, match="not a plain name"):
        Store(str(tmp_path), run=name)
    store = Store(str(tmp_path))
    commit(store)
    with pytest.raises(ArtifactError, match="not a plain name"):
        store.get(name)
    with pytest.raises(ArtifactError, match="not a plain name"):
        store.list(stage=name)
    assert not (tmp_path / "x").exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "default"
    ]
