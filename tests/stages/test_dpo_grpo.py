"""stages.dpo and stages.grpo on a tiny real policy in a tmp store.

DPO trains on hand-made pairs; GRPO on groups really sampled from the policy with the HF engine on
a fake env, so the stored ids and behaviour log-probs are the policy's own.
"""

from __future__ import annotations

import json
import math

import polars as pl
import pytest
import torch

import stages.sft_more
from data_contracts import groups as groups_contract
from data_contracts import pairs as pairs_contract
from flywheel.agent import run_episodes
from flywheel.chat import encode_chat
from flywheel.checkpoint import TRAIN_LOG, checkpoint_dir, load_policy, write_checkpoint
from flywheel.config import Config
from flywheel.engines.base import SamplingParams
from flywheel.engines.hf import HFEngine
from flywheel.envs.base import Task
from flywheel.model import build_tiny_model, train_tokenizer
from flywheel.store import Store
from flywheel.training.losses import (
    efficiency_reward,
    group_advantages,
    masked_ce,
    sequence_logprob,
)
from flywheel.trajectory import Trajectory
from stages import dpo, grpo
from stages.dpo import DpoConfig
from stages.grpo import GrpoConfig

CORPUS = [
    "Solve the task. Call <python>print(1 + 2)</python> to run code, then reply <answer>3</answer>.",
    "What is 37 + 12? Tom has 5 apples and buys 7 more.",
    "<python>print(37 + 12)</python> <answer>49</answer> Ok. Invalid action 49 12",
]
TRAIN = dict(micro_batch_size=8, max_length=256, warmup_ratio=0.0)


def msg(role: str, content: str, loss: bool = False) -> dict:
    return {"role": role, "content": content, "loss": loss}


PROMPT = [msg("user", "Solve the task."), msg("assistant", "Ok."), msg("user", "What is 37 + 12?")]
EXPERT = [
    msg("assistant", "<python>print(37 + 12)</python>", True),
    msg("user", "49"),
    msg("assistant", "<answer>49</answer>", True),
]


Cfg = Config


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A store holding a tiny policy as an ``init`` checkpoint, nudged for a few steps towards
    short actions so that some of its sampled turns end with the end-of-turn token and some are
    cut at max_new_tokens (both paths of the id alignment)."""
    store = Store(str(tmp_path_factory.mktemp("store")), run="test")
    tokenizer = train_tokenizer(CORPUS)
    model = build_tiny_model(
        tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=0
    )
    nudge(model, tokenizer, steps=15)
    w = store.writer("checkpoints", stage="init", round=0, config={}, inputs=[])
    policy = write_checkpoint(
        w, model, tokenizer, policy="init", round=0, parent="", base="embedded"
    )
    return store, tokenizer, policy


def nudge(model, tokenizer, steps: int) -> None:
    actions = ["<answer>49</answer>", "<python>print(37 + 12)</python>", "<answer>12</answer>"]
    batch = [encode_chat(tokenizer, [*PROMPT, msg("assistant", a, True)]) for a in actions]
    width = max(len(ids) for ids, _ in batch)
    ids = torch.tensor([i + [0] * (width - len(i)) for i, _ in batch])
    mask = torch.tensor([m + [0] * (width - len(m)) for _, m in batch])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = masked_ce(model(input_ids=ids).logits, ids, mask)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def train_log(store: Store, ref) -> list[dict]:
    return [
        json.loads(x) for x in (checkpoint_dir(store, ref) / TRAIN_LOG).read_text().splitlines()
    ]


# -- DPO --------------------------------------------------------------------------------------


def explored_side(tokenizer, answer: str) -> tuple[list[dict], list[list[int]]]:
    """An explored continuation (a tool call, its output, a wrong answer) and its stored ids.
    The answer's digits are stored as one-digit pieces while encoding the text gives one
    two-digit piece, so an example shows whether the stored ids were used."""
    piece = tokenizer.convert_tokens_to_ids
    eos = tokenizer.eos_token_id
    call = "<python>print(37 - 12)</python>"
    side = [
        msg("assistant", call, True),
        msg("user", "25"),
        msg("assistant", f"<answer>{answer}</answer>", True),
    ]
    ids = [
        tokenizer.encode(call, add_special_tokens=False) + [eos],
        [piece("<answer>"), *map(piece, answer), piece("</answer>"), eos],
    ]
    return side, ids


def pair_row(tokenizer, task: str, answer: str = "12", expert_wins: bool = True) -> dict:
    side, ids = explored_side(tokenizer, answer)
    expert = dict(side=EXPERT, source="expert", idx=-1, ids=[], reward=1.0)
    explored = dict(side=side, source="explore", idx=0, ids=ids, reward=0.0)
    chosen, rejected = (expert, explored) if expert_wins else (explored, expert)
    return {
        "task_id": task, "env": "arith", "round": 1, "policy": "init-x", "kind": "expert",
        "prompt": PROMPT, "chosen": chosen["side"], "rejected": rejected["side"],
        "chosen_reward": chosen["reward"], "rejected_reward": rejected["reward"],
        "chosen_source": chosen["source"], "rejected_source": rejected["source"],
        "chosen_sample_idx": chosen["idx"], "rejected_sample_idx": rejected["idx"],
        "chosen_turn_token_ids": chosen["ids"], "rejected_turn_token_ids": rejected["ids"],
    }  # fmt: skip


ANSWERS = ["12", "13", "21", "25", "37", "50"]


def write_pairs(store: Store, rows: list[dict], name: str):
    w = store.writer("pairs", stage="pareto", round=1, config={"name": name}, inputs=[])
    if rows:
        w.write_shard(0, rows)
    return w.commit()


def masked(ex: dict, side: str) -> list[int]:
    return [t for t, m in zip(ex[f"{side}_ids"], ex[f"{side}_mask"], strict=True) if m]


@pytest.mark.parametrize("expert_wins", [True, False])
def test_pair_example_trains_only_the_continuations_assistant_turns(world, expert_wins):
    _, tokenizer, _ = world
    ex = dpo.pair_example(tokenizer, pair_row(tokenizer, "t0", "12", expert_wins))
    prompt_ids, _ = encode_chat(tokenizer, PROMPT)
    for side in ("chosen", "rejected"):  # the prompt, "Ok." included, is never trained
        ids, mask = ex[f"{side}_ids"], ex[f"{side}_mask"]
        assert ids[: len(prompt_ids)] == prompt_ids and not any(mask[: len(prompt_ids)])
    expert, explored = ("chosen", "rejected") if expert_wins else ("rejected", "chosen")
    eos = tokenizer.eos_token
    # the expert's two turns (from text) with their end-of-turn tokens; not the observation "49"
    assert tokenizer.decode(masked(ex, expert)) == (
        f"<python>print(37 + 12)</python>{eos}<answer>49</answer>{eos}"
    )
    # the explored turns as stored (not re-tokenized), not the observation "25"
    stored = explored_side(tokenizer, "12")[1]
    assert masked(ex, explored) == stored[0] + stored[1]
    assert stored[1] != tokenizer.encode("<answer>12</answer>") + [tokenizer.eos_token_id]


def test_dpo_trains_with_precomputed_reference_and_caches(world):
    store, tokenizer, policy = world
    pairs = write_pairs(
        store, [pair_row(tokenizer, f"t{i}", answer) for i, answer in enumerate(ANSWERS)], "train"
    )
    cfg = Cfg(dpo=DpoConfig(lr=[5e-3], beta=[0.5, 0.1], epochs=4, **TRAIN))
    ref = dpo.run(cfg, store, policy, pairs, round=1)

    log = train_log(store, ref)
    losses = [e["loss"] for e in log]
    assert all(math.isfinite(v) for v in losses) and len(losses) == 4
    assert losses[0] == pytest.approx(math.log(2), abs=1e-4)  # policy == reference at step 0
    assert losses[-1] < losses[0] - 0.01 and "accuracy" in log[0]
    start, _ = load_policy(store, policy)
    trained, _ = load_policy(store, ref)
    assert not torch.allclose(params(start), params(trained))
    s = ref.summary
    assert s["pairs"] == 6 and s["beta"] == 0.5 and s["lr"] == 5e-3 and s["train_steps"] == 4
    assert s["final_loss"] == losses[-1] and s["reward_accuracy"] > 0.5 and s["reward_margin"] > 0

    # The saved reference log-probs are the starting policy's: recompute pair 4 by hand.
    saved = pl.read_parquet(checkpoint_dir(store, ref) / dpo.REF_LOGPS)
    assert saved["pair"].to_list() == list(range(6))
    ex = dpo.pair_example(tokenizer, pl.from_arrow(store.read(pairs)).row(4, named=True))
    with torch.no_grad():
        for side in ("chosen", "rejected"):
            ids, mask = torch.tensor([ex[f"{side}_ids"]]), torch.tensor([ex[f"{side}_mask"]])
            expected = sequence_logprob(start(input_ids=ids).logits, ids, mask).item()
            assert saved[f"ref_{side}_logp"][4] == pytest.approx(expected, abs=1e-4)
    assert store.read(pairs).num_rows == 6  # the pairs input is read, never rewritten

    fresh = Store(store.root_url, run="test")  # same config: a cache hit, nothing written
    assert dpo.run(cfg, fresh, policy, pairs, round=1).id == ref.id and not fresh.committed
    other = cfg.model_copy(
        update={"dpo": cfg.dpo.model_copy(update={"beta": [0.3], "max_steps": 1})}
    )
    assert dpo.run(other, fresh, policy, pairs, round=1).id != ref.id
    # Round 2 resolves to the last entries: another id from the same section.
    assert dpo.artifact_config(cfg, 2)["beta"] == 0.1 != dpo.artifact_config(cfg, 1)["beta"]


def test_dpo_frozen_reference_trains(world):
    store, tokenizer, policy = world
    pairs = write_pairs(
        store, [pair_row(tokenizer, "t0", "12"), pair_row(tokenizer, "t1", "37")], "frozen"
    )
    cfg = Cfg(dpo=DpoConfig(lr=[5e-3], epochs=2, reference="frozen", **TRAIN))
    ref = dpo.run(cfg, store, policy, pairs, round=3)
    losses = [e["loss"] for e in train_log(store, ref)]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-4) and losses[1] != losses[0]
    assert not (checkpoint_dir(store, ref) / dpo.REF_LOGPS).exists()


def test_no_pairs_passes_the_policy_on(world, capsys):
    store, _, policy = world
    ref = dpo.run(Cfg(), store, policy, write_pairs(store, [], "empty"), round=4)
    assert "WARNING" in capsys.readouterr().out
    assert ref.summary["skipped"] == "no pairs" and ref.summary["train_steps"] == 0
    # it still records its cost, so sft_more can match the compute of a round that skipped
    assert ref.summary["train_tokens"] == 0
    assert stages.sft_more.budget([ref], "tokens") == 0
    start, _ = load_policy(store, policy)
    same, _ = load_policy(store, ref)
    assert torch.equal(params(start), params(same))
    assert not (checkpoint_dir(store, ref) / TRAIN_LOG).exists()


# -- GRPO -------------------------------------------------------------------------------------


class LengthEnv:
    """Two steps; the reward is the second action's length (so samples differ), or 0.5 on a
    ``flat`` task (so its group is flat)."""

    def reset(self, task: Task) -> str:
        self.task, self.steps = task, 0
        return task.prompt

    def step(self, action: str):
        self.steps += 1
        info = {"tool_call": self.steps == 1, "tool_ok": self.steps == 1, "invalid": False}
        if self.steps < 2:
            return "49", 0.0, False, info
        reward = 0.5 if self.task.meta.get("flat") else min(1.0, len(action) / 40)
        return "", reward, True, {**info, "success": reward > 0.5}

    def close(self) -> None:
        pass


class LengthSuite:
    name = "fake"
    instruction = "Solve the task."

    def make(self) -> LengthEnv:
        return LengthEnv()


def group_rows(episodes: list[dict], policy_id: str) -> list[dict]:
    names = groups_contract.SCHEMA.names
    filler = {
        "round": 1, "policy": policy_id, "group_front": 1, "group_crowding": 1.0, "group_x1": 0.0,
        "group_x2": 0.0, "group_size": 4, "group_mean_reward": 0.0, "pareto_rank": 1,
    }  # fmt: skip
    return [{k: (ep | filler)[k] for k in names} for ep in episodes]


@pytest.fixture(scope="module")
def sampled(world):
    """Groups artifact of 3 tasks x 4 samples really generated by the policy; t2 is flat."""
    store, _, policy = world
    model, tokenizer = load_policy(store, policy)
    tasks = [
        Task(f"t{i}", "fake", "train", 0, 1, "What is 37 + 12?", "49", {"flat": i == 2})
        for i in range(3)
    ]
    episodes = run_episodes(
        HFEngine(model, tokenizer), LengthSuite(), tasks, samples_per_task=4,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=10, seed=1), max_steps=2, seed=1,
    )  # fmt: skip
    w = store.writer("groups", stage="pareto", round=1, config={"name": "sampled"}, inputs=[])
    w.write_shard(0, group_rows(episodes, policy.id))
    return w.commit()


def test_old_logprobs_sit_on_the_sampled_ids(world, sampled):
    store, tokenizer, policy = world
    model, _ = load_policy(store, policy)
    frame = pl.from_arrow(store.read(sampled))
    ends = [turn[-1] == tokenizer.eos_token_id for turn in frame["turn_token_ids"].explode()]
    assert any(ends) and not all(ends)  # both ended and cut turns are covered
    rows = frame.iter_rows(named=True)
    for row in rows:
        ex = grpo.trajectory_example(tokenizer, row, advantage=0.5)
        ids, mask, old = ex["input_ids"], ex["loss_mask"], ex["old_logprobs"]
        trained = [i for i, m in enumerate(mask) if m]
        assert [ids[i] for i in trained] == [t for turn in row["turn_token_ids"] for t in turn]
        stored = [lp for turn in row["turn_logprobs"] for lp in turn]
        assert [old[i] for i in trained] == pytest.approx(stored)
        assert all(old[i] == 0.0 for i in range(len(ids)) if not mask[i])
        # What the policy assigns those positions in one forward pass is what it sampled with.
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0]
        logp = torch.log_softmax(logits, -1)
        assert [logp[i - 1, ids[i]].item() for i in trained] == pytest.approx(stored, abs=1e-4)

    row = pl.from_arrow(store.read(sampled)).row(0, named=True)
    broken = row | {"turn_logprobs": [row["turn_logprobs"][0][:-1], *row["turn_logprobs"][1:]]}
    with pytest.raises(ValueError, match="turn_token_ids and turn_logprobs differ"):
        grpo.trajectory_example(tokenizer, broken, 1.0)
    more = row | {
        "turn_token_ids": [*row["turn_token_ids"], [5], [5]],  # 4 turns, 3 assistant messages
        "turn_logprobs": [*row["turn_logprobs"], [-1.0], [-1.0]],
    }
    with pytest.raises(ValueError, match="stored turns for"):
        grpo.trajectory_example(tokenizer, more, 1.0)


def test_flat_groups_are_dropped_and_advantages_are_group_relative(world, sampled):
    store, _, _ = world
    frame = pl.from_arrow(store.read(sampled))
    kept, counts = grpo.prepare(frame, GrpoConfig(), 0.0, 0.0)
    assert counts == {"groups_in": 3, "groups_flat": 1}
    assert set(kept["task_id"]) == {"t0", "t1"} and len(kept) == 8
    expected = group_advantages(kept["reward"].to_list(), kept["task_id"].to_list())
    assert kept["advantage"].to_list() == pytest.approx(expected.tolist())
    assert kept["advantage"].abs().sum() > 0

    everything, _ = grpo.prepare(frame, GrpoConfig(drop_flat_groups=False), 0.0, 0.0)
    assert len(everything) == 12
    assert everything.filter(pl.col("task_id") == "t2")["advantage"].to_list() == [0.0] * 4


def test_efficiency_reward_and_its_annealing(world, sampled):
    store, _, _ = world
    frame = pl.from_arrow(store.read(sampled)).with_columns(
        invalid_actions=pl.Series([1] + [0] * 11, dtype=pl.Int32)
    )
    gc = GrpoConfig(efficiency_reward=True)
    assert grpo.sharpness(gc, 1, 2) == (0.2, 0.5) and grpo.sharpness(gc, 2, 2) == (0.1, 0.25)
    shaped = grpo.rewards(frame, gc, 0.2, 0.5)
    ok = [True] * 12
    ok[0] = False  # an invalid action breaks the format
    expected = efficiency_reward(
        frame["reward"].to_list(), frame["tool_ok"].to_list(), frame["tokens"].to_list(),
        frame["task_id"].to_list(), ok, s_tool=0.2, s_len=0.5,
    )  # fmt: skip
    assert shaped == pytest.approx(expected.tolist()) and shaped[0] < 0
    # The flat task's samples differ in length, so their shaped rewards differ: the group is kept.
    assert len(set(frame["tokens"][8:])) > 1
    kept, counts = grpo.prepare(frame, gc, 0.2, 0.5)
    assert counts["groups_flat"] == 0 and len(kept) == 12


def test_grpo_trains_from_on_policy_groups(world, sampled):
    store, _, policy = world
    cfg = Cfg(grpo=GrpoConfig(lr=3e-3, epochs=3, **TRAIN | {"micro_batch_size": 4}))
    ref = grpo.run(cfg, store, policy, sampled, round=1)
    log = train_log(store, ref)
    # The stored behaviour log-probs are the starting policy's: the first ratio is 1, nothing clipped.
    assert log[0]["ratio"] == pytest.approx(1.0, abs=1e-3) and log[0]["clip_fraction"] == 0.0
    assert all(math.isfinite(e["loss"]) for e in log) and len(log) == 6  # 8 trajectories / 4 x 3
    assert len({round(e["loss"], 6) for e in log}) > 1 and log[-1]["ratio"] != pytest.approx(
        1.0, abs=1e-4
    )
    start, _ = load_policy(store, policy)
    trained, _ = load_policy(store, ref)
    assert not torch.allclose(params(start), params(trained))
    s = ref.summary
    assert (s["groups"], s["groups_flat"], s["trajectories"]) == (2, 1, 8)
    assert s["mean_abs_advantage"] > 0 and 0 <= s["clip_fraction"] <= 1
    assert grpo.run(cfg, Store(store.root_url, run="test"), policy, sampled, round=1).id == ref.id


def test_departure_credit_untrains_what_a_failure_does_after_leaving_the_better_samples(
    world, sampled
):
    store, tokenizer, policy = world
    frame, _ = grpo.prepare(pl.from_arrow(store.read(sampled)), GrpoConfig(), 0.0, 0.0)
    rows = list(frame.iter_rows(named=True))
    examples = [grpo.trajectory_example(tokenizer, r, r["advantage"]) for r in rows]
    keys, rewards = grpo.group_keys(frame), frame["train_reward"].to_list()
    cut, cleared = grpo.departure_credit(examples, keys, rewards)
    assert cleared == sum(
        sum(a["loss_mask"]) - sum(b["loss_mask"]) for a, b in zip(examples, cut, strict=True)
    )
    assert cleared > 0
    for i, (before, after) in enumerate(zip(examples, cut, strict=True)):
        if before["advantage"] >= 0:
            assert after == before  # successes and above-average samples train every token
            continue
        assert after["input_ids"] == before["input_ids"]
        better = [examples[j]["input_ids"] for j in range(len(rows))
                  if keys[j] == keys[i] and rewards[j] > rewards[i]]  # fmt: skip
        depart = max(
            next(
                (p for p, (x, y) in enumerate(zip(before["input_ids"], b, strict=False)) if x != y),
                min(len(b), len(before["input_ids"])),
            )
            for b in better
        )
        kept = [p for p, m in enumerate(after["loss_mask"]) if m]
        assert all(p <= depart for p in kept)
        assert kept == [p for p, m in enumerate(before["loss_mask"]) if m and p <= depart]

    base = Cfg(grpo=GrpoConfig(lr=3e-3, **TRAIN | {"micro_batch_size": 4}))
    departed = Cfg(
        grpo=GrpoConfig(lr=3e-3, failure_credit="departure", **TRAIN | {"micro_batch_size": 4})
    )
    # the published rule keeps the ids runs had before the field; the other rule is a new run
    assert "failure_credit" not in grpo.artifact_config(base, 1)["grpo"]
    ref = grpo.run(departed, store, policy, sampled, round=1)
    assert ref.id != grpo.run(base, store, policy, sampled, round=1).id
    assert ref.summary["tokens_after_departure"] == cleared


def test_only_flat_groups_pass_the_policy_on(world, sampled):
    store, _, policy = world
    flat = [r | {"reward": 0.5} for r in pl.from_arrow(store.read(sampled)).to_dicts()]
    w = store.writer("groups", stage="pareto", round=1, config={"name": "flat"}, inputs=[])
    w.write_shard(0, flat)
    ref = grpo.run(Cfg(), store, policy, w.commit(), round=2)
    assert ref.summary["skipped"] == "all groups flat" and ref.summary["train_steps"] == 0


def test_contracts_have_what_the_stages_read():
    # The stages read these columns; the contracts are written by the pareto stage.
    assert {"prompt", "chosen", "rejected", "chosen_turn_token_ids", "rejected_turn_token_ids",
            "task_id", "env", "kind", "chosen_sample_idx", "rejected_sample_idx"} <= set(pairs_contract.SCHEMA.names)  # fmt: skip
    assert {"env", "task_id", "sample_idx", "policy", "reward", "tool_ok", "tokens", "finish_reason",
            "invalid_actions", "messages", "turn_token_ids", "turn_logprobs"} <= set(groups_contract.SCHEMA.names)  # fmt: skip


# -- GRPO with MIX (expert NLL) ---------------------------------------------------------------


def trajectory_artifact(store: Store, stage: str, rows: list[dict]):
    from data_contracts import trajectories

    names = trajectories.SCHEMA.names
    filler = {"split": "train", "source": stage, "steps": 2, "seed": 0, "tool_errors": 0}
    w = store.writer("trajectories", stage=stage, round=1, config={"rows": len(rows)}, inputs=[])
    w.write_shard(
        0, [{k: (r | filler)[k] if k in r or k in filler else None for k in names} for r in rows]
    )
    return w.commit()


@pytest.fixture(scope="module")
def mix_inputs(world, sampled):
    """An explore artifact where t0 was solved once and t1, t2, t3 never; expert trajectories
    for t0..t3, the one for t3 a failure (the oracle missed it), so only t1 and t2 qualify."""
    store, _, _ = world
    frame = pl.from_arrow(store.read(sampled))
    explored = [
        r | {"success": r["task_id"] == "t0" and r["sample_idx"] == 0} for r in frame.to_dicts()
    ]
    explored += [r | {"task_id": "t3", "success": False} for r in frame.to_dicts()[:4]]
    gold = [
        frame.row(0, named=True)
        | {"task_id": t, "sample_idx": 0, "messages": [*PROMPT, *EXPERT], "success": t != "t3",
           "reward": float(t != "t3"), "turn_token_ids": None, "turn_logprobs": None}
        for t in ("t0", "t1", "t2", "t3")
    ]  # fmt: skip
    return trajectory_artifact(store, "explore", explored), trajectory_artifact(
        store, "expert", gold
    )


def sequence_nll(store: Store, ref, ids: list[int], mask: list[int]) -> float:
    """The mean NLL of the masked tokens of one fixed sequence under the checkpoint ``ref``."""
    model, _ = load_policy(store, ref)
    batch = torch.tensor([ids])
    with torch.no_grad():
        return masked_ce(model(input_ids=batch).logits, batch, torch.tensor([mask])).item()


def test_mix_takes_expert_trajectories_of_unsolved_tasks_only(world, mix_inputs):
    store, _, _ = world
    explored, expert = (pl.from_arrow(store.read(ref)) for ref in mix_inputs)
    gc = GrpoConfig(expert_weight=0.1)
    picked = grpo.unsolved_expert(explored, expert, n_policy=8, gc=gc, seed=0)
    assert sorted(picked["task_id"]) == ["t1", "t2"]  # t0 solved, t3's expert failed
    # expert_ratio caps the share: 0.5 of 3 trained trajectories -> 3 expert ones wanted, 1/3 -> 1.
    one = grpo.unsolved_expert(
        explored, expert, n_policy=2, gc=GrpoConfig(expert_ratio=1 / 3), seed=0
    )
    assert len(one) == 1
    again = grpo.unsolved_expert(
        explored, expert, n_policy=2, gc=GrpoConfig(expert_ratio=1 / 3), seed=0
    )
    assert one["task_id"].to_list() == again["task_id"].to_list()


def test_grpo_mix_trains_the_expert_turns_and_records_its_inputs(world, sampled, mix_inputs):
    store, tokenizer, policy = world
    explored, expert = mix_inputs
    cfg = Cfg(
        grpo=GrpoConfig(lr=3e-3, epochs=3, expert_weight=0.5, **TRAIN | {"micro_batch_size": 4})
    )
    with pytest.raises(ValueError, match="needs the round's explore and the expert artifacts"):
        grpo.run(cfg, store, policy, sampled, round=1)
    ref = grpo.run(cfg, store, policy, sampled, explored, expert, round=1)
    assert ref.inputs == [policy.id, sampled.id, explored.id, expert.id]
    s = ref.summary
    assert (s["groups"], s["trajectories"], s["expert_trajectories"]) == (2, 8, 2)
    log = train_log(store, ref)
    assert len(log) == 9 and all(math.isfinite(e["expert_nll"]) for e in log)  # 10 rows / 4 x 3
    # The expert's answer became more likely; plain GRPO (weight 0) reads neither extra artifact.
    ids, mask = encode_chat(tokenizer, [*PROMPT, *EXPERT])

    def nll(ref_):
        return sequence_nll(store, ref_, ids, mask)

    plain_cfg = GrpoConfig(lr=3e-3, epochs=3, **TRAIN | {"micro_batch_size": 4})
    plain = grpo.run(Cfg(grpo=plain_cfg), store, policy, sampled, explored, expert, round=1)
    assert plain.inputs == [policy.id, sampled.id] and "expert_trajectories" not in plain.summary
    print(f"expert NLL: start {nll(policy):.3f}, GRPO {nll(plain):.3f}, MIX {nll(ref):.3f}")
    assert nll(ref) < min(nll(policy), nll(plain)) - 0.2


def test_mix_own_takes_the_best_success_of_each_solved_task(world, mix_inputs):
    store, _, _ = world
    explored = pl.from_arrow(store.read(mix_inputs[0]))
    # A second success of t0 (sample 1) with more tokens: rft's rule keeps sample 0 only.
    explored = explored.with_columns(
        success=pl.col("success") | ((pl.col("task_id") == "t0") & (pl.col("sample_idx") == 1)),
        reward=pl.when(pl.col("task_id") == "t0").then(pl.col("reward")).otherwise(0.0),
        tokens=pl.col("tokens") + pl.col("sample_idx"),
    )
    gc = GrpoConfig(expert_weight=0.1, mix_source="own")
    picked = grpo.own_successes(explored, n_policy=8, gc=gc, seed=0)
    assert picked.select("task_id", "sample_idx").rows() == [("t0", 0)]
    # The cap: 0.5 of 0 trained trajectories leaves none.
    assert grpo.own_successes(explored, n_policy=0, gc=gc, seed=0).is_empty()


def test_grpo_mix_own_trains_its_successes_and_reads_no_expert(world, sampled, mix_inputs):
    store, tokenizer, policy = world
    explored, expert = mix_inputs
    gc = GrpoConfig(
        lr=3e-3, epochs=3, expert_weight=0.5, mix_source="own", **TRAIN | {"micro_batch_size": 4}
    )
    with pytest.raises(ValueError, match="mix_source own needs the round's explore"):
        grpo.run(Cfg(grpo=gc), store, policy, sampled, round=1)
    ref = grpo.run(Cfg(grpo=gc), store, policy, sampled, explored, expert, round=1)
    assert ref.inputs == [policy.id, sampled.id, explored.id]
    assert ref.summary["own_trajectories"] == 1 and "expert_trajectories" not in ref.summary
    # The one success (t0, sample 0) became more likely than under plain GRPO.
    row = pl.from_arrow(store.read(explored)).filter(
        (pl.col("task_id") == "t0") & (pl.col("sample_idx") == 0)
    )
    ids, mask = Trajectory.from_row(row.row(0, named=True)).encode(tokenizer)

    def nll(ref_):
        return sequence_nll(store, ref_, ids, mask)

    plain_gc = GrpoConfig(lr=3e-3, epochs=3, **TRAIN | {"micro_batch_size": 4})
    plain = grpo.run(Cfg(grpo=plain_gc), store, policy, sampled, explored, expert, round=1)
    print(
        f"own success NLL: start {nll(policy):.3f}, GRPO {nll(plain):.3f}, MIX own {nll(ref):.3f}"
    )
    assert nll(ref) < nll(policy) - 0.1 and nll(ref) < nll(plain) - 0.2
