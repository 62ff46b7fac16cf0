"""Kill sweep: each long stage (explore, sft, dpo, grpo, evaluate) is SIGKILLed at a random point
while it runs, in a child process of its own; the rerun must finish with an artifact equal in
content to an uninterrupted run's (same rows, none duplicated or missing; the same weights),
and a training stage killed after a train state was saved must resume from it, not from zero.

    .venv/bin/python -m pytest tests/reliability/test_kill_sweep.py -s          # small sweep (CI)
    make test-reliability                  # full sweep: many kills per stage, plus `flywheel run`

A kill lands at a random point of the stage's progress: after the k-th of its progress lines
(training steps, finished shards; k uniform from 0, when the child announces the stage, to the
number an uninterrupted run prints), plus a uniform 0-0.5 s (in the CI-size sweep, k in the
middle half and the extra delay under half a progress line's time), so kills hit model loading,
rollouts, shard writes, training steps, train-state saves and the commit alike. ``KILLS_PER_STAGE`` and
``SWEEP_SEED`` (environment) set the size and the random seed; the tallies are printed and
appended to ``$FLYWHEEL_SWEEP_REPORT`` when set.

The base store (tasks, expert, init, explore and pareto of round 1) is built once; the targets
read only it: sft (round 0, from init on the demonstrations), explore (round 2 of init), dpo and
grpo (round 1, from init) and evaluate (init on the test tasks, round 1). GRPO's groups are the
real explored rows of init with one sample of every other task rewarded, since the untrained
policy solves nothing and pareto keeps no flat group.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from data_contracts import groups as groups_contract
from flywheel.config import load_config
from flywheel.store import ArtifactRef, Store
from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ("explore", "sft", "dpo", "grpo", "evaluate")
# Long enough to be killed inside: one task (K=2) per explore shard, 2 test tasks per evaluate
# shard, tens of training steps with a train state saved every 4.
SWEEP = (
    "envs.arith.n_test=16",
    "envs.arith.max_steps=4",
    "engine.max_new_tokens=24",
    "explore.shard_size=2",
    "evaluate.shard_size=2",
    "sft.max_steps=48",
    "sft.epochs=100",
    "sft.micro_batch_size=4",
    "sft.checkpoint_every=4",
    "dpo.epochs=100",
    "dpo.max_steps=40",
    "dpo.micro_batch_size=4",
    "dpo.checkpoint_every=4",
    "grpo.epochs=100",
    "grpo.max_steps=40",
    "grpo.micro_batch_size=4",
    "grpo.checkpoint_every=4",
)

CHILD = """
import json, sys
from tests.reliability.test_kill_sweep import run_target
run_target(json.loads(sys.argv[1]), sys.argv[2], announce=True)
"""
PROGRESS = re.compile(r"^(\[train \w+\] step |(explore|evaluate): shard )", re.M)


def child_env() -> dict[str, str]:
    """Our environment without this process's torch.distributed rendezvous (its port is taken)."""
    dist = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in dist}


RESUMED = re.compile(r"\[train \w+\] resumed at step (\d+)/(\d+)")
SHARDS_KEPT = re.compile(r"(explore|evaluate): resuming, (\d+)/(\d+) shards already written")


def base_refs(cfg, store: Store) -> dict[str, ArtifactRef]:
    """The inputs of every target (cache hits once built)."""
    import stages.expert
    import stages.explore
    import stages.init
    import stages.pareto
    import stages.tasks

    train, val, test = stages.tasks.run(cfg, store)
    expert = stages.expert.run(cfg, store, train, val)
    init = stages.init.run(cfg, store, expert, train)
    explored = stages.explore.run(cfg, store, init, train, round=1)
    pairs, _ = stages.pareto.run(cfg, store, explored, expert, round=1)
    groups = sweep_groups(store, explored)
    return dict(
        train=train, val=val, test=test, expert=expert, init=init, explored=explored,
        pairs=pairs, groups=groups,
    )  # fmt: skip


def sweep_groups(store: Store, explored: ArtifactRef) -> ArtifactRef:
    """Groups of init's real samples, sample 0 of every other task rewarded (see the docstring)."""
    w = store.writer("groups", stage="pareto", round=1, config={"sweep": 1}, inputs=[explored.id])
    if w.cached:
        return w.ref
    table = store.read(explored)
    rows = []
    filler = {"group_front": 1, "group_crowding": 1.0, "group_x1": 0.0, "group_x2": 0.25,
              "group_size": 2, "group_mean_reward": 0.5, "pareto_rank": 1}  # fmt: skip
    for i, row in enumerate(
        sorted(table.to_pylist(), key=lambda r: (r["task_id"], r["sample_idx"]))
    ):
        won = (i // 2) % 2 == 0 and row["sample_idx"] == 0
        row = row | filler | {"reward": float(won), "success": won}
        rows.append({k: row[k] for k in groups_contract.SCHEMA.names})
    w.write_shard(0, rows)
    return w.commit()


def run_target(overrides: list[str], target: str, announce: bool = False) -> ArtifactRef:
    """Run one target stage on the base store (its inputs are cache hits)."""
    import stages.dpo
    import stages.evaluate
    import stages.explore
    import stages.grpo
    import stages.sft

    cfg = load_config(None, overrides)
    store = Store(cfg.run.store_root(), cfg.run.name)
    b = base_refs(cfg, store)
    val = {"val_tasks": b["val"], "val_demos": b["expert"]}
    if announce:
        print("STAGE START", flush=True)
    if target == "sft":
        ref = stages.sft.run(cfg, store, b["init"], [b["expert"]], round=0, **val)
    elif target == "explore":
        ref = stages.explore.run(cfg, store, b["init"], b["train"], round=2)
    elif target == "dpo":
        ref = stages.dpo.run(cfg, store, b["init"], b["pairs"], round=1, **val)
    elif target == "grpo":
        ref = stages.grpo.run(
            cfg, store, b["init"], b["groups"], b["explored"], b["expert"], round=1, **val
        )
    else:
        ref = stages.evaluate.run(cfg, store, b["init"], b["test"], round=1)
    if announce:
        print(f"STAGE DONE {ref.id}", flush=True)
    return ref


def content(store: Store, ref: ArtifactRef) -> dict:
    """What must equal an uninterrupted run's: rows (sorted by their key, each once) for data,
    weights and the per-step training losses for checkpoints."""
    if ref.kind == "checkpoints":
        folder = Path(ref.path)
        weights = load_file(str(folder / "model.safetensors"))
        log = folder / "train_log.jsonl"
        losses = (
            [json.loads(line)["loss"] for line in log.read_text().splitlines()]
            if log.exists()
            else []
        )
        return {"weights": weights, "losses": losses, "steps": ref.summary.get("train_steps")}
    rows = store.read(ref).to_pylist()
    keys = [(r["task_id"], r.get("sample_idx", 0)) for r in rows]
    assert len(keys) == len(set(keys)), f"{ref.id}: duplicated rows"
    return {"rows": sorted(rows, key=lambda r: (r["task_id"], r.get("sample_idx", 0)))}


def same(a: dict, b: dict) -> str | None:
    """None when equal, else what differs."""
    if "weights" in a:
        if a["weights"].keys() != b["weights"].keys():
            return "different parameter names"
        bad = [k for k in a["weights"] if not torch.equal(a["weights"][k], b["weights"][k])]
        if bad:
            return f"weights differ: {bad[:3]}"
        if a["losses"] != b["losses"] or a["steps"] != b["steps"]:
            return f"training losses differ: {a['losses']} vs {b['losses']}"
        return None
    if len(a["rows"]) != len(b["rows"]):
        return f"{len(a['rows'])} rows vs {len(b['rows'])}"
    diff = [i for i, (x, y) in enumerate(zip(a["rows"], b["rows"], strict=True)) if x != y]
    return f"{len(diff)} rows differ (first: {a['rows'][diff[0]]['task_id']})" if diff else None


@dataclass
class Tally:
    tried: int = 0
    survived: int = 0
    in_stage: int = 0  # killed before the commit (the rest landed after it: a cache hit)
    resumed: int = 0  # trainings that resumed from a saved train state
    shards_kept: int = 0  # explore/evaluate reruns that kept finished shards
    failures: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """The base store, and each target's uninterrupted artifact content and duration."""
    root = tmp_path_factory.mktemp("sweep")
    overrides = tiny_overrides(root / "base", *SWEEP)
    cfg = load_config(None, overrides)
    with contextlib.redirect_stdout(io.StringIO()):
        base_refs(cfg, Store(cfg.run.store_root(), cfg.run.name))
    reference = copy_base(root, "reference")
    refs, took, lines = {}, {}, {}
    for target in TARGETS:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            t0 = time.perf_counter()
            refs[target] = run_target(reference, target)
            took[target] = time.perf_counter() - t0
        lines[target] = len(PROGRESS.findall(printed.getvalue()))
        assert lines[target] >= 4, f"{target} printed {lines[target]} progress lines"
    ref_store = Store(load_config(None, reference).run.store_root(), "tiny")
    expected = {t: content(ref_store, r) for t, r in refs.items()}
    return root, expected, took, lines


def copy_base(root: Path, name: str) -> list[str]:
    """A copy of the base store under ``root/name``; returns its overrides."""
    shutil.copytree(root / "base" / "store", root / name / "store")
    return tiny_overrides(root / name, *SWEEP)


def kill_once(
    root: Path, target: str, at: tuple[int, float], trial: str, tally: Tally, expected
) -> None:
    """Run ``target`` in a child, SIGKILL it after its ``at[0]``-th progress line plus ``at[1]``
    seconds, rerun it here and compare with the uninterrupted run."""
    overrides = copy_base(root, trial)
    cfg = load_config(None, overrides)
    stage_dir = (
        Path(cfg.run.store_root())
        / "tiny"
        / ("round-0" if target == "sft" else "round-2" if target == "explore" else "round-1")
        / target
    )
    log = root / f"{trial}.log"
    with open(log, "w") as out:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(overrides), target],
            cwd=ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # the kill reaches the sandbox's calls too
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while True:
            text = log.read_text()
            started = "STAGE START" in text
            if started and len(PROGRESS.findall(text.split("STAGE START", 1)[1])) >= at[0]:
                break
            if child.poll() is not None:
                assert started and child.returncode == 0, f"child failed:\n{text[-2000:]}"
                break  # the stage finished before that line: the kill lands after the commit
            assert time.monotonic() < deadline, "child did not reach the kill point in 180 s"
            time.sleep(0.005)
        time.sleep(at[1])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait(30)
    tally.tried += 1
    committed = "STAGE DONE" in log.read_text()
    tmp = next(iter(stage_dir.glob(".tmp-*")), None) if stage_dir.exists() else None
    latest = tmp / "_train_state" / "latest" if tmp else None
    saved_step = (
        int(latest.read_text().strip().removeprefix("step")) if latest and latest.exists() else 0
    )
    shards = len(list(tmp.glob("part-*.parquet"))) if tmp else 0

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        ref = run_target(overrides, target)
    out = printed.getvalue()
    problem = same(content(Store(cfg.run.store_root(), "tiny"), ref), expected[target])
    resumed = RESUMED.search(out)
    kept = SHARDS_KEPT.search(out)
    if not committed:
        tally.in_stage += 1
    if saved_step and not committed:
        if not resumed or int(resumed[1]) != saved_step:
            problem = (
                problem
                or f"train state at step {saved_step} was saved but the rerun printed: {resumed and resumed[0]}"
            )
        else:
            tally.resumed += 1
    if kept:
        tally.shards_kept += 1
        if int(kept[2]) > shards:
            problem = problem or f"rerun kept {kept[2]} shards, only {shards} were on disk"
    if problem is None:
        tally.survived += 1
    else:
        where = f"after progress line {at[0]} + {at[1]:.2f}s"
        tally.failures.append(f"{target} killed {where}: {problem} (log {log})")
    shutil.rmtree(root / trial, ignore_errors=True)


def sweep_kills(sweep, kills_per_stage: int, seed: int, middle: bool = False) -> dict[str, Tally]:
    """``middle``: kill in the middle half of the progress lines only, so that one kill per
    stage is sure to exercise the resume (a train state saved, shards finished) and lands
    before the commit."""
    root, expected, took, lines = sweep
    rng = random.Random(seed)
    tallies = {t: Tally() for t in TARGETS}
    for i in range(kills_per_stage):
        for target in TARGETS:
            n = lines[target]
            k = rng.randint(n // 4, 3 * n // 4) if middle else rng.randint(0, n)
            # In the middle half the extra delay stays under half a progress line's time, so the
            # kill cannot outlast a short stage (evaluate runs in about a second) and land after
            # its commit; the full sweep keeps 0-0.5 s to reach the commit too.
            extra = min(0.5, 0.5 * took[target] / max(n, 1)) if middle else 0.5
            at = (k, rng.uniform(0, extra))
            kill_once(root, target, at, f"{target}-{i}", tallies[target], expected)
    report(tallies, seed, took)
    return tallies


def report(tallies: dict[str, Tally], seed: int, took: dict[str, float]) -> None:
    lines = [f"kill sweep (seed {seed}): stage, uninterrupted s, kills tried / survived, "
             "landed before the commit, trainings resumed, reruns that kept shards"]  # fmt: skip
    for t, y in tallies.items():
        lines.append(
            f"  {t:<9} {took[t]:5.1f}s  {y.tried:3d} / {y.survived:3d}  in stage {y.in_stage:3d}  "
            f"resumed {y.resumed:3d}  shards kept {y.shards_kept:3d}"
        )
    tried = sum(y.tried for y in tallies.values())
    survived = sum(y.survived for y in tallies.values())
    lines.append(f"kills tried / survived: {tried} / {survived}")
    text = "\n".join(lines)
    print("\n" + text)
    if os.environ.get("FLYWHEEL_SWEEP_REPORT"):
        with open(os.environ["FLYWHEEL_SWEEP_REPORT"], "a") as fh:
            fh.write(text + "\n")


@pytest.mark.slow
def test_small_kill_sweep(sweep):
    """One random kill in the middle of each long stage (CI): each must resume."""
    tallies = sweep_kills(sweep, 1, int(os.environ.get("SWEEP_SEED", "0")), middle=True)
    failures = [f for y in tallies.values() for f in y.failures]
    assert not failures, "\n".join(failures)
    assert all(tallies[t].resumed == 1 for t in ("sft", "dpo", "grpo")), tallies
    assert all(tallies[t].shards_kept == 1 for t in ("explore", "evaluate")), tallies


@pytest.mark.slow
@pytest.mark.reliability_full
def test_full_kill_sweep(sweep):
    """``KILLS_PER_STAGE`` (default 10) random kills per long stage."""
    n = int(os.environ.get("KILLS_PER_STAGE", "10"))
    tallies = sweep_kills(sweep, n, int(os.environ.get("SWEEP_SEED", "1")))
    failures = [f for y in tallies.values() for f in y.failures]
    assert not failures, "\n".join(failures)
    # The sweep must have exercised resumption, not only kills before the work or after it.
    assert sum(y.resumed for y in tallies.values()) > 0
    assert sum(y.shards_kept for y in tallies.values()) > 0
