"""The stages called directly (no Prefect) on the tiny config: tasks -> expert -> init ->
evaluate(init) -> sft -> evaluate(sft) -> explore(round 1), then the store's caching rules on the
real stages: same config = cache hit, ``force`` = new version, a changed input = new artifact."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import polars as pl
import pytest
import torch

import stages.evaluate
import stages.expert
import stages.explore
import stages.init
import stages.sft
import stages.tasks
from flywheel.checkpoint import load_policy, unchanged_checkpoint
from flywheel.config import load_config
from flywheel.metrics import flatten, summarize
from flywheel.store import ArtifactError, Store
from stages._common import load_tasks
from tests.conftest import tiny_overrides

METRICS = (
    "success_rate",
    "avg_reward",
    "n_tasks",
    "n_episodes",
    "tool_success",
    "efficiency",
    "reasoning_tokens",
)
N_TRAIN, N_VAL, N_TEST, K = 24, 8, 8, 2


def run_chain(cfg, store):
    train, val, test = stages.tasks.run(cfg, store)
    refs = {"tasks": train, "val": val, "test": test}
    refs["expert"] = stages.expert.run(cfg, store, train, val)
    refs["init"] = stages.init.run(cfg, store, refs["expert"], train)
    refs["eval_init"] = stages.evaluate.run(cfg, store, refs["init"], test, round=0)
    refs["sft"] = stages.sft.run(cfg, store, refs["init"], [refs["expert"]], round=0)
    refs["eval_sft"] = stages.evaluate.run(cfg, store, refs["sft"], test, round=0)
    refs["explore"] = stages.explore.run(cfg, store, refs["sft"], train, round=1)
    return refs


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("stages")
    cfg = load_config(None, tiny_overrides(root))
    store = Store(cfg.run.store_root(), cfg.run.name)
    refs = run_chain(cfg, store)
    return cfg, store, refs


def test_every_stage_writes_its_artifact_kind(chain):
    _, store, refs = chain
    kinds = {name: ref.kind for name, ref in refs.items()}
    assert kinds == {
        "tasks": "tasks",
        "val": "tasks",
        "test": "tasks",
        "expert": "trajectories",
        "init": "checkpoints",
        "eval_init": "eval",
        "sft": "checkpoints",
        "eval_sft": "eval",
        "explore": "trajectories",
    }
    # every one was written by this process, and each is a committed folder with a manifest
    assert {ref.id for ref in refs.values()} == store.committed
    for name, ref in refs.items():
        assert (Path(ref.path) / "manifest.json").is_file(), name
        assert ref.id.startswith(ref.stage + "-")
        assert not list(Path(ref.path).parent.glob(".tmp-*")), f"{name} left a temporary folder"
    assert refs["explore"].round == 1 and refs["sft"].round == 0


def test_row_counts_and_lineage(chain):
    _, store, refs = chain
    for split, n in (("tasks", N_TRAIN), ("val", N_VAL), ("test", N_TEST)):
        tasks = pl.from_arrow(store.read(refs[split]))
        name = "train" if split == "tasks" else split
        assert len(tasks) == n and set(tasks["split"]) == {name}
        assert refs[split].summary == {f"arith/{name}_tasks": n}
        assert refs[split].manifest["split"] == name
    expert = pl.from_arrow(store.read(refs["expert"]))
    assert len(expert) == N_TRAIN + N_VAL  # every train task has a demonstration by default
    assert set(expert["source"]) == {"expert"}
    assert expert["split"].value_counts().sort("split").rows() == [
        ("train", N_TRAIN),
        ("val", N_VAL),
    ]
    train_rows = expert.filter(pl.col("split") == "train")
    assert refs["expert"].summary["arith/oracle_success"] == pytest.approx(
        train_rows["success"].mean()
    )
    for name in ("init", "sft"):
        assert store.read(refs[name]).num_rows == 1
    assert store.read(refs["eval_init"]).num_rows == N_TEST
    assert store.read(refs["eval_sft"]).num_rows == N_TEST
    assert store.read(refs["explore"]).num_rows == N_TRAIN * K
    # inputs are the artifact ids the stage read
    assert refs["expert"].inputs == [refs["tasks"].id, refs["val"].id]
    assert refs["sft"].inputs == [refs["init"].id, refs["expert"].id]
    assert refs["explore"].inputs == [refs["sft"].id, refs["tasks"].id]
    assert refs["eval_sft"].inputs == [refs["sft"].id, refs["test"].id]
    lineage = store.lineage(refs["explore"].id)
    assert [node["id"] for node in lineage["inputs"]] == [refs["sft"].id, refs["tasks"].id]


@pytest.mark.parametrize("name", ["eval_init", "eval_sft", "explore"])
def test_summary_has_every_metric_per_env(chain, name):
    _, store, refs = chain
    ref = refs[name]
    frame = pl.from_arrow(
        store.read(ref, columns=["env", "task_id", "success", "reward", "tokens"])
    )
    for metric in METRICS:
        assert f"arith/{metric}" in ref.summary, metric
        assert math.isfinite(ref.summary[f"arith/{metric}"])
    # the summary is computed from the rows, not made up
    assert ref.summary["arith/n_episodes"] == len(frame)
    assert ref.summary["arith/n_tasks"] == frame["task_id"].n_unique()
    assert ref.summary["arith/n_tasks"] == (len(frame) / K if name == "explore" else len(frame))
    assert ref.summary["arith/success_rate"] == pytest.approx(frame["success"].mean())
    assert ref.summary["arith/avg_reward"] == pytest.approx(frame["reward"].sum() / len(frame))
    assert ref.summary["arith/reasoning_tokens"] == pytest.approx(frame["tokens"].mean())
    assert 0 <= ref.summary["arith/tool_success"] <= 1


def test_eval_records_the_policy_it_evaluated(chain):
    _, store, refs = chain
    for eval_name, policy_name in (("eval_init", "init"), ("eval_sft", "sft")):
        ref = refs[eval_name]
        assert ref.manifest["policy"] == refs[policy_name].id
        assert ref.manifest["policy_stage"] == policy_name
        rows = pl.from_arrow(store.read(ref, columns=["policy", "policy_stage", "round"]))
        assert set(rows["policy"]) == {refs[policy_name].id}
        assert set(rows["policy_stage"]) == {policy_name}
    # init and sft are evaluated on the same tasks in the same round: different artifacts
    assert refs["eval_init"].id != refs["eval_sft"].id


def test_sft_trains_and_changes_the_parameters(chain):
    _, store, refs = chain
    sft = refs["sft"]
    assert sft.summary["train_steps"] == 3
    assert math.isfinite(sft.summary["final_loss"]) and sft.summary["final_loss"] > 0
    assert sft.summary["examples"] == N_TRAIN
    init_model, _ = load_policy(store, refs["init"])
    sft_model, _ = load_policy(store, sft)
    init_state, sft_state = init_model.state_dict(), sft_model.state_dict()
    assert init_state.keys() == sft_state.keys()
    changed = [k for k in init_state if not torch.equal(init_state[k], sft_state[k])]
    assert len(changed) >= len(init_state) // 2, f"only {changed} changed"
    assert all(torch.isfinite(t).all() for t in sft_state.values())
    row = store.read(sft).to_pylist()[0]
    assert row["parent"] == refs["init"].id and row["policy"] == "sft"
    log = (Path(sft.path) / "train_log.jsonl").read_text().splitlines()
    assert len(log) == 3


def test_explore_rows_carry_aligned_ids_and_logprobs(chain):
    _, store, refs = chain
    rows = store.read(refs["explore"]).to_pylist()
    assert {r["policy"] for r in rows} == {refs["sft"].id}
    assert {r["source"] for r in rows} == {"explore"}
    assert {r["round"] for r in rows} == {1}
    per_task = pl.DataFrame([{"t": r["task_id"], "k": r["sample_idx"]} for r in rows])
    assert (
        per_task.group_by("t").agg(pl.col("k").sort()).get_column("k").to_list()
        == [[0, 1]] * N_TRAIN
    )
    for r in rows:
        ids, lps = r["turn_token_ids"], r["turn_logprobs"]
        sampled = [m for m in r["messages"][2:] if m["role"] == "assistant"]
        assert len(ids) == len(lps) == len(sampled) == r["steps"] >= 1
        assert [len(t) for t in ids] == [len(t) for t in lps]
        assert all(1 <= len(t) <= 12 for t in ids)  # engine.max_new_tokens
        assert all(lp <= 0 and math.isfinite(lp) for t in lps for lp in t)
        assert r["tokens"] == sum(len(t) for t in ids)
    # K samples of a task are drawn, not copied
    assert len({tuple(map(tuple, r["turn_token_ids"])) for r in rows}) > N_TRAIN
    # 8-episode shards: 4 tasks x K=2 each
    assert refs["explore"].manifest["shards"] == [f"part-{i:05d}.parquet" for i in range(6)]


def test_second_call_is_a_cache_hit(chain):
    cfg, store, refs = chain
    fresh = Store(cfg.run.store_root(), cfg.run.name)
    again = run_chain(cfg, fresh)
    assert {k: r.id for k, r in again.items()} == {k: r.id for k, r in refs.items()}
    assert fresh.committed == set()
    for ref in again.values():
        assert ref.id not in fresh.committed


def test_force_writes_a_new_version_and_downstream_follows(tiny_config):
    cfg = tiny_config  # a store of its own: the new version must not leak into the chain's
    store = Store(cfg.run.store_root(), cfg.run.name)
    tasks, val, _ = stages.tasks.run(cfg, store)
    expert = stages.expert.run(cfg, store, tasks, val)
    fresh = Store(cfg.run.store_root(), cfg.run.name)
    forced, forced_val, forced_test = stages.tasks.run(cfg, fresh, force=True)
    assert forced.id == tasks.id + ".2"
    assert fresh.committed == {forced.id, forced_val.id, forced_test.id}
    # same content, new version: later runs pick the newest, and what reads it reruns
    assert store.read(forced).equals(store.read(tasks))
    assert stages.tasks.run(cfg, Store(cfg.run.store_root(), cfg.run.name))[0].id == forced.id
    expert2 = stages.expert.run(cfg, fresh, forced, forced_val)
    assert expert2.id != expert.id and expert2.id in fresh.committed
    assert expert2.inputs == [forced.id, forced_val.id]
    # the old versions are still readable
    assert fresh.get(tasks.id).id == tasks.id
    assert stages.expert.run(cfg, fresh, tasks, val, force=True).id == expert.id + ".2"


def test_changed_stage_config_reruns_only_that_stage(chain, tmp_path):
    cfg, store, refs = chain
    changed = load_config(
        None, tiny_overrides(Path(cfg.run.work_dir).parent, "evaluate.temperature=0.5")
    )
    fresh = Store(changed.run.store_root(), changed.run.name)
    # the checkpoints do not depend on evaluate's section
    assert (
        stages.sft.run(changed, fresh, refs["init"], [refs["expert"]], round=0).id == refs["sft"].id
    )
    ev = stages.evaluate.run(changed, fresh, refs["sft"], refs["test"], round=0)
    assert ev.id != refs["eval_sft"].id and fresh.committed == {ev.id}
    assert ev.manifest["config"]["evaluate"]["temperature"] == 0.5


def test_missing_artifact_is_a_clear_error(chain):
    _, store, _ = chain
    with pytest.raises(ArtifactError, match="no artifact explore-nope"):
        store.get("explore-nope")


def test_expert_resumed_after_a_crash_summarises_every_env(tmp_path, monkeypatch):
    cfg = load_config(None, tiny_overrides(tmp_path))
    cfg.envs = [
        cfg.envs[0],
        cfg.envs[0].model_copy(
            update={"name": "arith2", "suite": "flywheel.envs.arith:ArithSuite"}
        ),
    ]
    store = Store(cfg.run.store_root(), cfg.run.name)
    tasks, val, _ = stages.tasks.run(cfg, store)
    real = stages.expert.expert_episodes
    calls = []

    def crash_on_second_env(suite, env_tasks, **kwargs):
        calls.append(suite.name)
        if len(calls) == 3:  # the second env's train split (each env runs train, then val)
            raise RuntimeError("killed")
        return real(suite, env_tasks, **kwargs)

    monkeypatch.setattr(stages.expert, "expert_episodes", crash_on_second_env)
    with pytest.raises(RuntimeError, match="killed"):
        stages.expert.run(cfg, store, tasks, val)
    monkeypatch.setattr(stages.expert, "expert_episodes", real)
    ref = stages.expert.run(cfg, Store(cfg.run.store_root(), cfg.run.name), tasks, val)
    # the first env's shards came from the crashed run and still count in the summary
    assert calls == ["arith", "arith", "arith2"]
    assert ref.summary == {
        "arith/oracle_success": 1.0, "arith2/oracle_success": 1.0,
        "arith/train_demonstrations": N_TRAIN, "arith2/train_demonstrations": N_TRAIN,
        "arith/val_demonstrations": N_VAL, "arith2/val_demonstrations": N_VAL,
    }  # fmt: skip


def test_evaluate_counts_failed_steps_as_played_and_replays_only_a_crashed_runs_shards(
    tmp_path, monkeypatch, capsys
):
    """The recovery count comes from the step infos of the episodes evaluate plays, with no
    replay; after a crash, only the episodes of the shard the killed run left are replayed, and
    the summary is the one an uninterrupted run writes (and the one replaying every episode
    gives)."""
    cfg = load_config(None, [*tiny_overrides(tmp_path), "evaluate.shard_size=4"])
    clean, crashed = Store(str(tmp_path / "clean"), "tiny"), Store(str(tmp_path / "crash"), "tiny")
    for store in (clean, crashed):
        train, val, test = stages.tasks.run(cfg, store)
        init = stages.init.run(cfg, store, stages.expert.run(cfg, store, train, val), train)
    replayed: list[str] = []
    replay_infos = stages.evaluate.replay_infos

    def counted(suite, task, messages):
        replayed.append(task.task_id)
        return replay_infos(suite, task, messages)

    monkeypatch.setattr(stages.evaluate, "replay_infos", counted)
    whole = stages.evaluate.run(cfg, clean, init, test, round=0)
    assert replayed == [] and "replaying" not in capsys.readouterr().out
    assert whole.summary["arith/failed_episodes"] > 0  # the untrained policy's actions fail
    everything = stages.evaluate.replay_columns(cfg, clean, test, clean.read(whole))
    assert len(replayed) == N_TEST and everything is not None
    frame = pl.from_arrow(clean.read(whole).drop("messages")).join(
        everything, on=["env", "task_id"]
    )
    assert (
        flatten(summarize(frame))["arith/failed_episodes"] == whole.summary["arith/failed_episodes"]
    )

    run_episodes, calls = stages.evaluate.run_episodes, []

    def killed_on_the_second_shard(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("killed")
        return run_episodes(*args, **kwargs)

    monkeypatch.setattr(stages.evaluate, "run_episodes", killed_on_the_second_shard)
    with pytest.raises(RuntimeError, match="killed"):
        stages.evaluate.run(cfg, crashed, init, test, round=0)
    monkeypatch.setattr(stages.evaluate, "run_episodes", run_episodes)
    replayed.clear()
    capsys.readouterr()
    resumed = stages.evaluate.run(cfg, crashed, init, test, round=0)
    assert "replaying the 4 arith episodes a crashed run left" in capsys.readouterr().out
    first = pl.from_arrow(crashed.read(resumed, columns=["task_id"]))["task_id"].head(4)
    assert sorted(replayed) == sorted(first.to_list())  # the crashed run's shard only
    assert resumed.id == whole.id and resumed.summary == whole.summary


def test_explore_rounds_take_successive_windows_of_the_train_tasks(chain):
    cfg, store, refs = chain
    every = [t.task_id for t in load_tasks(store, refs["tasks"], env="arith", split="train")]
    assert len(every) == N_TRAIN
    windows = [
        [
            t.task_id
            for t in load_tasks(
                store, refs["tasks"], env="arith", split="train", limit=10, window=w
            )
        ]
        for w in range(3)
    ]
    assert windows[0] == every[:10] and windows[1] == every[10:20]
    assert windows[2] == every[20:] + every[:6]  # wraps around the end of the split
    # explore with n_tasks: round 2 explores the second window (its own artifact, new prompts)
    cfg2 = load_config(None, [*tiny_overrides(Path(cfg.run.work_dir).parent), "explore.n_tasks=10"])
    r1 = stages.explore.run(cfg2, store, refs["sft"], refs["tasks"], round=1)
    r2 = stages.explore.run(cfg2, store, refs["sft"], refs["tasks"], round=2)
    ids1 = pl.from_arrow(store.read(r1, columns=["task_id"]))["task_id"].unique().sort().to_list()
    ids2 = pl.from_arrow(store.read(r2, columns=["task_id"]))["task_id"].unique().sort().to_list()
    assert ids1 == sorted(windows[0]) and ids2 == sorted(windows[1])


def test_a_policy_with_evaluated_weights_reuses_that_evaluation(chain, monkeypatch):
    """A checkpoint with the SFT policy's weights under another id (a round that passed its
    policy on) is evaluated by copying the SFT evaluation's episodes, without playing any."""
    cfg, store, refs = chain
    sft, test = refs["sft"], refs["test"]
    digest = sft.summary["weights_sha256"]
    assert len(digest) == 64 and digest != refs["init"].summary["weights_sha256"]
    w = store.writer("checkpoints", stage="dpo", round=1, config={"twin": 1}, inputs=[sft.id])
    twin = unchanged_checkpoint(w, store, sft, stage="dpo", round=1, reason="a test")
    assert twin.summary["weights_sha256"] == digest

    # Other settings (a temperature no evaluation here used), other tasks, or only its own
    # evaluation: nothing to reuse.
    hot = cfg.model_copy(update={"evaluate": cfg.evaluate.model_copy(update={"temperature": 0.3})})
    assert stages.evaluate.evaluated_twin(hot, store, twin, test) is None
    assert stages.evaluate.evaluated_twin(cfg, store, twin, refs["val"]) is None
    assert stages.evaluate.evaluated_twin(cfg, store, refs["init"], test) is None
    assert stages.evaluate.evaluated_twin(cfg, store, twin, test).id == refs["eval_sft"].id
    broken = Path(refs["eval_sft"].path).parent / "evaluate-000000000000"
    broken.mkdir()
    (broken / "manifest.json").write_text("{not json")  # a damaged evaluation is skipped
    assert stages.evaluate.evaluated_twin(cfg, store, twin, test).id == refs["eval_sft"].id
    shutil.rmtree(broken)

    def no_episodes(*args, **kwargs):
        raise AssertionError("an evaluation that could be reused played its episodes")

    monkeypatch.setattr(stages.evaluate, "run_episodes", no_episodes)
    monkeypatch.setattr(stages.evaluate, "replay_columns", no_episodes)  # summary copied too
    ev = stages.evaluate.run(cfg, store, twin, test, round=1)
    assert ev.manifest["reused_from"] == refs["eval_sft"].id
    assert ev.manifest["policy"] == twin.id and ev.summary == refs["eval_sft"].summary
    mine, theirs = store.read(ev), store.read(refs["eval_sft"])
    labels = ["policy", "policy_stage", "round"]
    assert mine.drop(labels).equals(theirs.drop(labels))
    rows = pl.from_arrow(mine.select(labels))
    assert rows.unique().rows() == [(twin.id, "dpo", 1)]
    with pytest.raises(AssertionError, match="played its episodes"):  # force plays them again
        stages.evaluate.run(cfg, store, twin, test, round=1, force=True)
