"""The crash acceptance test: explore is SIGKILLed after some shards are written and before the
manifest; no reader sees the artifact; the rerun keeps the finished shards (the very same files),
does only the rest, and the result equals an uninterrupted run's."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import stages.expert
import stages.explore
import stages.init
import stages.tasks
from flywheel.config import load_config
from flywheel.store import ArtifactError, Store
from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
N_TRAIN, K = 48, 2
# One task (K=2 episodes) per shard: 48 shards of ~0.1 s each leave seconds to kill in between.
SLOW = (
    f"envs.arith.n_train={N_TRAIN}",
    "explore.shard_size=2",
    "engine.max_new_tokens=24",
    "envs.arith.max_steps=4",
)

CHILD = """
import json, sys
from flywheel.config import load_config
from flywheel.store import Store
import stages.explore
cfg = load_config(None, json.loads(sys.argv[1]))
store = Store(cfg.run.store_root(), cfg.run.name)
stages.explore.run(cfg, store, store.get(sys.argv[2]), store.get(sys.argv[3]), round=1)
print("CHILD FINISHED", flush=True)
"""


def prepare(root: Path):
    overrides = tiny_overrides(root, *SLOW)
    cfg = load_config(None, overrides)
    store = Store(cfg.run.store_root(), cfg.run.name)
    tasks, val, _ = stages.tasks.run(cfg, store)
    init = stages.init.run(cfg, store, stages.expert.run(cfg, store, tasks, val), tasks)
    return overrides, cfg, tasks, init


def kill_after_first_shard(
    overrides, policy_id, tasks_id, stage_dir: Path, log: Path, timeout=180.0
):
    """Start explore in a child, SIGKILL it once a shard is finished but no manifest exists.
    Returns the temporary folder it was writing."""
    with open(log, "w") as out:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(overrides), policy_id, tasks_id],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the kill reaches any sandbox child
        )
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            tmp = next(iter(stage_dir.glob(".tmp-explore-*")), None) if stage_dir.exists() else None
            if tmp is not None and list(tmp.glob("part-*.parquet")):
                os.killpg(child.pid, signal.SIGKILL)
                child.wait(30)
                return tmp
            if child.poll() is not None:
                pytest.fail(
                    f"explore finished (rc={child.returncode}) before a shard could be seen; make the "
                    f"shards smaller or slower (SLOW). Child output:\n{log.read_text()[-3000:]}"
                )
            time.sleep(0.005)
        pytest.fail(
            f"no explore shard within {timeout:.0f}s. Child output:\n{log.read_text()[-3000:]}"
        )
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(30)


@pytest.mark.slow
def test_explore_killed_mid_run_resumes_keeping_finished_shards(tmp_path):
    overrides, cfg, tasks, init = prepare(tmp_path / "a")
    stage_dir = Path(cfg.run.store_root()) / cfg.run.name / "round-1" / "explore"
    tmp = kill_after_first_shard(overrides, init.id, tasks.id, stage_dir, tmp_path / "child.log")

    # killed: a temporary folder with finished shards, no manifest, nothing visible to readers
    art_id = tmp.name.removeprefix(".tmp-")
    assert not (tmp / "manifest.json").exists()
    assert not (stage_dir / art_id).exists()
    reader = Store(cfg.run.store_root(), cfg.run.name)
    assert reader.list(stage="explore") == []
    assert reader.latest("explore") is None
    with pytest.raises(ArtifactError, match=f"no artifact {art_id}"):
        reader.get(art_id)
    before = {
        p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes())
        for p in tmp.glob("part-*.parquet")
    }
    total = N_TRAIN  # one task per shard
    assert 1 <= len(before) < total, (
        f"the child wrote {len(before)}/{total} shards before the kill; make the shards slower"
    )

    # rerun: the finished shards are kept and only the rest is done
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ref = stages.explore.run(cfg, reader, init, tasks, round=1)
    printed = out.getvalue()
    assert ref.id == art_id and ref.id in reader.committed
    assert f"explore: resuming, {len(before)}/{total} shards already written" in printed
    assert printed.count("explore: shard ") == total - len(before)
    final = Path(ref.path)
    for name, (inode, mtime, data) in before.items():
        stat = (final / name).stat()
        assert (stat.st_ino, stat.st_mtime_ns) == (inode, mtime), f"{name} was rewritten"
        assert (final / name).read_bytes() == data
    assert not tmp.exists() and not list(final.glob("*.part"))

    # complete: every task x K, the manifest agrees with the files, and readers see it
    assert ref.manifest["rows"] == N_TRAIN * K
    assert ref.manifest["shards"] == sorted(p.name for p in final.glob("part-*.parquet"))
    assert len(ref.manifest["shards"]) == total
    table = Store(cfg.run.store_root(), cfg.run.name).read(ref.id)
    assert table.num_rows == N_TRAIN * K
    pairs = set(
        zip(
            table.column("task_id").to_pylist(), table.column("sample_idx").to_pylist(), strict=True
        )
    )
    assert len(pairs) == N_TRAIN * K
    assert [r.id for r in reader.list(stage="explore")] == [ref.id]

    # and it is what an uninterrupted run writes: shards are seeded by their index
    _, cfg_b, tasks_b, init_b = prepare(tmp_path / "b")
    store_b = Store(cfg_b.run.store_root(), cfg_b.run.name)
    with contextlib.redirect_stdout(io.StringIO()):
        ref_b = stages.explore.run(cfg_b, store_b, init_b, tasks_b, round=1)
    assert ref_b.id == ref.id
    assert store_b.read(ref_b).equals(table)
