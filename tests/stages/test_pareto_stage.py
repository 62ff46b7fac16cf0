"""stages.pareto end to end on a tiny synthetic explore/expert pair of artifacts in a tmp store."""

import numpy as np
import polars as pl

from data_contracts import groups as groups_contract
from data_contracts import pairs as pairs_contract
from flywheel.config import Config, ParetoConfig
from flywheel.store import Store
from stages import pareto

Cfg = Config


def row(task, env, sample_idx, reward, turns, tool_calls, source="explore"):
    msgs = [
        {"role": "user", "content": f"task {task}", "loss": False},
        {"role": "assistant", "content": "Ok.", "loss": False},
        {"role": "user", "content": "first observation", "loss": False},
    ]
    for i in range(turns):
        msgs += [
            {"role": "assistant", "content": f"act {i}", "loss": True},
            {"role": "user", "content": f"obs {i}", "loss": False},
        ]
    generated = source == "explore"
    return {
        "task_id": task,
        "env": env,
        "split": "train",
        "round": 1 if generated else 0,
        "policy": "sft-1" if generated else "oracle",
        "source": source,
        "sample_idx": sample_idx,
        "messages": msgs,
        "reward": reward,
        "success": reward >= 1.0,
        "steps": turns,
        "tool_calls": tool_calls,
        "tool_errors": 0,
        "tool_ok": tool_calls,
        "invalid_actions": 0,
        "tokens": 7 * turns,
        "finish_reason": "done",
        "seed": sample_idx,
        "turn_token_ids": [[i, i + 1] for i in range(turns)] if generated else [],
        "turn_logprobs": [[-0.1, -0.2] for _ in range(turns)] if generated else [],
    }


def write(store, stage, round, rows):
    w = store.writer("trajectories", stage=stage, round=round, config={"n": len(rows)}, inputs=[])
    w.write_shard(0, rows)
    return w.commit()


def make_inputs(store, n_tasks=12, k=4, seed=0):
    rng = np.random.default_rng(seed)
    explore, expert = [], []
    for t in range(n_tasks):
        env = "arith" if t % 2 == 0 else "wiki"
        for i in range(k):
            if env == "arith":
                reward = float(rng.random() < 0.5)
            else:
                reward = float(np.round(rng.random(), 2))
            explore.append(
                row(f"t{t}", env, i, reward, int(rng.integers(1, 6)), int(rng.integers(0, 4)))
            )
        expert.append(row(f"t{t}", env, 0, 1.0, 2, 1, source="expert"))
    return write(store, "explore", 1, explore), write(store, "expert", 0, expert)


def test_stage_end_to_end(tmp_path, capsys):
    store = Store(str(tmp_path), run="test")
    explore, expert = make_inputs(store)
    cfg = Cfg(pareto=ParetoConfig(budget=3, shard_rows=10))
    pairs_ref, groups_ref = pareto.run(cfg, store, explore, expert, round=1)

    assert (pairs_ref.kind, groups_ref.kind) == ("pairs", "groups")
    assert pairs_ref.stage == groups_ref.stage == "pareto" and pairs_ref.id != groups_ref.id
    assert pairs_ref.inputs == [explore.id, expert.id]

    pairs = pl.from_arrow(store.read(pairs_ref))
    assert pairs.columns == pairs_contract.SCHEMA.names
    assert len(pairs) == pairs_ref.summary["pairs"] > 0
    assert set(pairs["kind"]) == {"expert", "best_worst"}
    assert (pairs["chosen_reward"] > pairs["rejected_reward"]).all()
    assert pairs["round"].unique().to_list() == [1]
    for side in ("chosen", "rejected"):
        assert pairs[side].list.last().struct.field("role").eq("assistant").all()
    assert pairs_ref.summary["pairs_expert"] + pairs_ref.summary["pairs_best_worst"] == len(pairs)
    assert pairs_ref.summary["mean_reward_gap"] > 0

    groups = pl.from_arrow(store.read(groups_ref))
    assert groups.columns == groups_contract.SCHEMA.names
    s = groups_ref.summary
    assert s["groups"] == 12 and s["groups_selected"] == 3 <= s["groups_eligible"]
    assert groups.select(pl.struct("env", "task_id").n_unique()).item() == 3
    assert len(groups) == s["trajectories_selected"] == 12  # K = 4 rows per selected group
    assert groups["group_front"].min() == 1 and (groups["group_size"] == 4).all()
    assert groups["pareto_rank"].min() == 1
    # a whole group per task, the behaviour log-probs kept for the PPO ratio
    assert groups.group_by("task_id").len()["len"].to_list() == [4, 4, 4]
    assert groups["turn_logprobs"].list.len().gt(0).all()
    assert (
        tmp_path / "test" / "round-1" / "pareto" / groups_ref.id / pareto.PLOT
    ).stat().st_size > 1000
    assert len(groups_ref.manifest["shards"]) == 2  # 12 rows in shards of 10

    # same config and inputs: both cache hits; another budget: a new groups artifact only
    assert pareto.run(cfg, store, explore, expert, round=1) == (pairs_ref, groups_ref)
    cfg2 = Cfg(pareto=ParetoConfig(budget=None, shard_rows=10))
    pairs2, groups2 = pareto.run(cfg2, store, explore, expert, round=1)
    assert pairs2 == pairs_ref  # same id: a cache hit
    assert (
        groups2.id != groups_ref.id and groups2.summary["groups_selected"] == s["groups_eligible"]
    )
    cfg3 = Cfg(pareto=ParetoConfig(budget=3, shard_rows=10, margin=0.5))
    pairs3, groups3 = pareto.run(cfg3, store, explore, expert, round=1)
    assert groups3 == groups_ref and pairs3.id != pairs_ref.id
    assert pairs3.summary["pairs_best_worst"] <= pairs_ref.summary["pairs_best_worst"]
