"""Determinism: the same config and seed give byte-identical data artifacts (tasks, expert,
pairs and groups mined from the same explore), identical greedy evaluations, and, with the same
number of CPU threads, identical sampled exploration, in another process too.

    .venv/bin/python -m pytest tests/reliability/test_determinism.py

What varies, and why (README, Guarantees): the explore rows' behaviour log-probs
(``turn_logprobs``) depend on the number of intra-op threads torch uses (``OMP_NUM_THREADS``):
a matmul sums in another order, and the log-probs move in the last bits (measured: 1,221 of
15,855 log-probs, at most 9.5e-7 apart, between 1 and 2 threads; the sampled tokens, rewards
and every other column were equal). A sampled token can flip where two tokens' probabilities
tie to within that much, and the episode then goes another way. Sandbox calls that hit their
wall-clock timeout on a loaded machine change an observation the same way.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import stages.evaluate
import stages.expert
import stages.explore
import stages.init
import stages.pareto
import stages.sft
import stages.tasks
from flywheel.config import load_config
from flywheel.store import ArtifactRef, Store
from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
# More samples and longer turns than the tiny default, so sampling has room to differ.
EXTRA = ("explore.samples_per_task=4", "engine.max_new_tokens=24", "sft.max_steps=6")

CHILD = """
import contextlib, io, json, sys
from tests.reliability.test_determinism import build
with contextlib.redirect_stdout(io.StringIO()):
    refs = build(sys.argv[1])
print(json.dumps({k: v.id for k, v in refs.items()}))
"""


def build(root: str) -> dict[str, ArtifactRef]:
    """tasks -> expert -> init -> sft -> explore -> pareto, and a greedy evaluate of sft."""
    cfg = load_config(None, tiny_overrides(Path(root), *EXTRA))
    store = Store(cfg.run.store_root(), cfg.run.name)
    train, val, test = stages.tasks.run(cfg, store)
    expert = stages.expert.run(cfg, store, train, val)
    init = stages.init.run(cfg, store, expert, train)
    sft = stages.sft.run(cfg, store, init, [expert], round=0)
    explore = stages.explore.run(cfg, store, sft, train, round=1)
    pairs, groups = stages.pareto.run(cfg, store, explore, expert, round=1)
    evaluate = stages.evaluate.run(cfg, store, sft, test, round=1)
    return dict(
        train=train, val=val, test=test, expert=expert, sft=sft, explore=explore, pairs=pairs,
        groups=groups, evaluate=evaluate,
    )  # fmt: skip


def shard_bytes(ref: ArtifactRef) -> list[bytes]:
    return [p.read_bytes() for p in sorted(Path(ref.path).glob("part-*.parquet"))]


def rows(root: Path, ref_id: str) -> list[dict]:
    store = Store(str(root / "store"), "tiny")
    found = store.read(store.get(ref_id)).to_pylist()
    return sorted(found, key=lambda r: (r["task_id"], r.get("sample_idx", 0)))


@pytest.fixture(scope="module")
def twice(tmp_path_factory):
    """The same config built twice: here, and in a child process with the same threads."""
    a = tmp_path_factory.mktemp("a")
    b = tmp_path_factory.mktemp("b")
    with contextlib.redirect_stdout(io.StringIO()):
        refs_a = build(str(a))
    # Not this process's torch.distributed rendezvous (its port is taken here).
    dist = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in dist}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(b)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ids_b = json.loads(done.stdout.strip().splitlines()[-1])
    return a, refs_a, b, ids_b


@pytest.mark.slow
def test_data_artifacts_are_byte_identical(twice):
    """Same ids, and the very same Parquet bytes (each shard's footer names its artifact, so
    only artifacts of the same id can be byte-equal). Pairs and groups are mined from explores
    that are themselves identical."""
    a, refs_a, b, ids_b = twice
    store_b = Store(str(b / "store"), "tiny")
    for name in ("train", "val", "test", "expert", "explore", "pairs", "groups", "evaluate"):
        ref_b = store_b.get(ids_b[name])
        assert refs_a[name].id == ref_b.id, name
        assert shard_bytes(refs_a[name]) == shard_bytes(ref_b), f"{name} shards differ"
    assert refs_a["pairs"].manifest["rows"] > 0


@pytest.mark.slow
def test_greedy_evaluation_and_training_are_identical(twice):
    a, refs_a, b, ids_b = twice
    assert refs_a["sft"].id == ids_b["sft"]
    weights = [Path(refs_a["sft"].path, "model.safetensors").read_bytes()]
    weights.append((b / "store" / "tiny" / "round-0" / "sft" / ids_b["sft"] / "model.safetensors").read_bytes())  # fmt: skip
    assert weights[0] == weights[1]
    assert refs_a["evaluate"].id == ids_b["evaluate"]
    assert rows(a, refs_a["evaluate"].id) == rows(b, ids_b["evaluate"])


@pytest.mark.slow
def test_sampled_exploration_is_reproducible_for_a_seed(twice):
    """Every column of every row, behaviour log-probs included (same thread count)."""
    a, refs_a, b, ids_b = twice
    assert refs_a["explore"].id == ids_b["explore"]
    here, there = rows(a, refs_a["explore"].id), rows(b, ids_b["explore"])
    assert len(here) == 24 * 4 and here == there
    # and the sampling really samples: the K samples of a task are not all alike
    by_task: dict[str, set[str]] = {}
    for r in here:
        by_task.setdefault(r["task_id"], set()).add(json.dumps(r["turn_token_ids"]))
    assert sum(len(v) > 1 for v in by_task.values()) > len(by_task) // 2
