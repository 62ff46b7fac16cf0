"""The baselines and the data regime they are measured in: RFT's choice of trajectories,
sft_more's compute matching (budget from the rounds' manifests, trained up to it), demonstrations
for part of the train tasks only, and pairs and MIX where a task has no demonstration."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import polars as pl
import pytest

import stages.expert
import stages.init
import stages.rft
import stages.sft
import stages.sft_more
import stages.tasks
from flywheel.config import GrpoConfig, load_config
from flywheel.pareto import build_pairs
from flywheel.store import ArtifactRef, Store
from stages import grpo
from tests.conftest import tiny_overrides
from tests.flywheel.test_pareto import episode, frame

N_TRAIN, N_DEMOS, N_VAL = 24, 8, 8


@pytest.fixture(scope="module")
def boot(tmp_path_factory):
    """The tiny bootstrap with demonstrations for the first 8 of 24 train tasks."""
    root = tmp_path_factory.mktemp("baselines")
    cfg = load_config(None, tiny_overrides(root, f"expert.n_tasks={N_DEMOS}"))
    store = Store(cfg.run.store_root(), cfg.run.name)
    with contextlib.redirect_stdout(io.StringIO()):
        train, val, test = stages.tasks.run(cfg, store)
        expert = stages.expert.run(cfg, store, train, val)
        init = stages.init.run(cfg, store, expert, train)
        sft = stages.sft.run(cfg, store, init, [expert], round=0)
    return cfg, store, {"train": train, "val": val, "expert": expert, "sft": sft}


def test_expert_n_tasks_gives_demonstrations_for_tasks_spread_over_the_split(boot):
    _, store, refs = boot
    rows = pl.from_arrow(store.read(refs["expert"], columns=["task_id", "split"]))
    train_ids = pl.from_arrow(store.read(refs["train"], columns=["task_id"]))["task_id"].to_list()
    # 8 of 24: every third task, so any window a round explores holds its share of them
    assert rows.filter(pl.col("split") == "train")["task_id"].to_list() == train_ids[::3]
    assert stages.expert.spread(list(range(10)), 4) == [0, 2, 5, 7]
    assert stages.expert.spread(list(range(3)), None) == [0, 1, 2]
    assert rows.filter(pl.col("split") == "val").height == N_VAL
    assert refs["expert"].summary["arith/train_demonstrations"] == N_DEMOS
    # the tokenizer still knows the words of the tasks without a demonstration
    assert refs["train"].id in stages.init.run(*boot[:2], refs["expert"], refs["train"]).inputs


def test_train_seed_reaches_the_model_init(boot):
    """run.train_seed draws another init (new id, other weights) from the same tasks; set to
    run.seed it is the init the run already has."""
    cfg, store, refs = boot
    with contextlib.redirect_stdout(io.StringIO()):
        same = stages.init.run(cfg, store, refs["expert"], refs["train"])
        run = cfg.run.model_copy(update={"train_seed": cfg.run.seed})
        again = stages.init.run(
            cfg.model_copy(update={"run": run}), store, refs["expert"], refs["train"]
        )
        run = cfg.run.model_copy(update={"train_seed": cfg.run.seed + 5})
        other = stages.init.run(
            cfg.model_copy(update={"run": run}), store, refs["expert"], refs["train"]
        )
    assert again.id == same.id and other.id != same.id
    assert not same_weights(store, same, other)


def same_weights(store: Store, a: ArtifactRef, b: ArtifactRef) -> bool:
    """Whether two checkpoint artifacts hold the same tensors, name by name."""
    import torch

    from flywheel.checkpoint import load_policy

    x, y = (load_policy(store, ref)[0].state_dict() for ref in (a, b))
    assert x.keys() == y.keys()
    return all(torch.equal(x[k], y[k]) for k in x)


def fake_round(art_id: str, tokens: int, steps: int) -> ArtifactRef:
    manifest = {"summary": {"train_tokens": tokens, "train_steps": steps}, "inputs": []}
    return ArtifactRef(
        id=art_id, kind="checkpoints", stage="dpo", round=1, path="", manifest=manifest
    )


def test_sft_more_budget_is_the_rounds_compute():
    rounds = [fake_round("dpo-a", 1000, 5), fake_round("dpo-b", 2500, 7)]
    assert stages.sft_more.budget(rounds, "tokens") == 3500
    assert stages.sft_more.budget(rounds, "steps") == 12
    bad = ArtifactRef(id="dpo-c", kind="checkpoints", stage="dpo", round=1, path="", manifest={})
    with pytest.raises(ValueError, match="do not record train_tokens"):
        stages.sft_more.budget([bad], "tokens")


@pytest.mark.parametrize("match", ["tokens", "steps"])
def test_sft_more_trains_up_to_the_budget(boot, match):
    cfg, store, refs = boot
    cfg = cfg.model_copy(update={"sft_more": cfg.sft_more.model_copy(update={"match": match})})
    rounds = [fake_round("dpo-a", 900, 3), fake_round("grpo-b", 700, 2)]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        ref = stages.sft_more.run(cfg, store, refs["sft"], refs["expert"], rounds, round=2)
    s = ref.summary
    assert ref.inputs == [refs["sft"].id, refs["expert"].id, "dpo-a", "grpo-b"]
    # its progress lines name the stage, not the loss it trains with
    assert "[train sft_more] step " in out.getvalue() and "[train sft]" not in out.getvalue()
    if match == "tokens":
        # stops at the first step that reaches the budget: within one step's tokens of it
        assert s["budget"] == 1600 and s["stop_reason"] == "tokens"
        assert 1600 <= s["train_tokens"] < 1600 + 8 * cfg.sft_more.max_length
    else:
        assert s["budget"] == 5 and s["train_steps"] == 5
    # trained on the demonstrations only (train split), from the SFT policy
    assert s["examples"] == N_DEMOS and store.read(ref).to_pylist()[0]["parent"] == refs["sft"].id


def test_baseline_seed_changes_its_data_order(boot):
    """sft_more.seed draws another data order: a new id and other weights from the same data;
    set to run.seed it is the baseline the run already has. Micro-batches of 2 over the 8
    demonstrations, so the order decides what each step sees."""
    cfg, store, refs = boot
    rounds = [fake_round("dpo-a", 900, 3)]

    def train(seed):
        section = cfg.sft_more.model_copy(
            update={"match": "steps", "micro_batch_size": 2, "seed": seed}
        )
        c = cfg.model_copy(update={"sft_more": section})
        with contextlib.redirect_stdout(io.StringIO()):
            return stages.sft_more.run(c, store, refs["sft"], refs["expert"], rounds, round=1)

    same, again, other = train(None), train(cfg.run.seed), train(cfg.run.seed + 7)
    assert again.id == same.id and other.id != same.id
    assert same.summary["train_steps"] == other.summary["train_steps"] == 3
    assert not same_weights(store, same, other)


def test_rft_keeps_the_best_successful_sample_per_task_once():
    rows = [
        episode("a", 0, reward=1.0, turns=3, tool_calls=2, tokens=30),
        episode("a", 1, reward=1.0, turns=2, tool_calls=1, tokens=20),  # best: fewer calls
        episode("a", 2, reward=1.0, turns=2, tool_calls=1, tokens=20),  # same text as 1
        episode("a", 3, reward=0.0, turns=1),
        episode("b", 0, reward=0.0, turns=2),  # no success: nothing from b
        episode("c", 0, reward=1.0, turns=2, tool_calls=1, tokens=25),
        episode("c", 1, reward=1.0, turns=4, tool_calls=3, tokens=40),
    ]
    explored = frame(rows)
    one = stages.rft.select_successes(explored, per_task=1)
    assert sorted(zip(one["task_id"], one["sample_idx"], strict=True)) == [("a", 1), ("c", 0)]
    two = stages.rft.select_successes(explored, per_task=2)
    # sample 2 repeats sample 1's text: the second pick for a is sample 0
    assert sorted(zip(two["task_id"], two["sample_idx"], strict=True)) == [
        ("a", 0), ("a", 1), ("c", 0), ("c", 1),
    ]  # fmt: skip
    val = explored.with_columns(split=pl.lit("val"))
    assert stages.rft.select_successes(val, per_task=1).is_empty()  # never the val split


def test_pairs_without_a_demonstration_are_best_vs_worst_only():
    explored = frame(
        [episode("a", 0, 1.0), episode("a", 1, 0.0), episode("b", 0, 1.0), episode("b", 1, 0.0)]
    )
    gold = frame([episode("a", source="expert", reward=1.0, turns=2)])
    pairs = build_pairs(explored, gold)
    kinds = sorted(zip(pairs["task_id"], pairs["kind"], strict=True))
    assert kinds == [("a", "best_worst"), ("a", "expert"), ("b", "best_worst")]
    only_rewards = build_pairs(explored, gold.clear())
    assert sorted(only_rewards["kind"]) == ["best_worst", "best_worst"]


def test_mix_takes_expert_rows_only_where_a_demonstration_exists():
    explored = pl.DataFrame(
        [{"env": "arith", "task_id": t, "success": False} for t in ("a", "b", "c")]
    )
    gold = pl.DataFrame(
        [
            {"env": "arith", "task_id": "a", "success": True, "split": "train"},
            {"env": "arith", "task_id": "v", "success": True, "split": "val"},
        ]
    )
    gc = GrpoConfig(expert_weight=0.5, expert_ratio=0.5)
    picked = grpo.unsolved_expert(explored, gold, n_policy=10, gc=gc, seed=0)
    assert picked["task_id"].to_list() == ["a"]  # b and c have no demonstration; v is val


def test_a_validation_of_the_same_weights_is_not_run_again(boot, monkeypatch):
    """Two sft_more runs from the SFT policy (other data orders): the second takes the numbers
    of the SFT policy's validation from the first's manifest instead of validating it again;
    validated another way (more val tasks), it validates."""
    import stages._common

    cfg, store, refs = boot
    rounds = [fake_round("dpo-a", 900, 3)]
    calls: list[int] = []
    real = stages._common._val_success

    def counted(*args, **kwargs):
        validate = real(*args, **kwargs)

        def wrapped(module):
            calls.append(1)
            return validate(module)

        return wrapped

    monkeypatch.setattr(stages._common, "_val_success", counted)

    def train(seed, val_tasks=4):
        knobs = {"match": "steps", "micro_batch_size": 2, "seed": seed, "val_every": 2}
        c = cfg.model_copy(
            update={
                "sft_more": cfg.sft_more.model_copy(update=knobs | {"val_metric": "success"}),
                "evaluate": cfg.evaluate.model_copy(update={"val_tasks": val_tasks}),
            }
        )
        before = len(calls)
        with contextlib.redirect_stdout(io.StringIO()) as out:
            ref = stages.sft_more.run(
                c, store, refs["sft"], refs["expert"], rounds, round=1, val_tasks=refs["val"]
            )
        return ref, len(calls) - before, out.getvalue()

    first, n_first, _ = train(21)
    assert n_first == 3  # 3 steps: before the first, after step 2, after the last
    start = first.summary["val_start"]
    assert set(start) >= {"key", "score", "val_success"}
    # A damaged artifact elsewhere in the store does not stop the search (nor the training).
    broken = Path(refs["sft"].path).parents[1] / "dpo" / "dpo-000000000000"
    broken.mkdir(parents=True)
    (broken / "manifest.json").write_text("{not json")
    second, n_second, printed = train(22)
    assert n_second == n_first - 1 and "validate step 0" in printed and "(known:" in printed
    assert second.summary["val_start"] == start and second.id != first.id
    _, n_other, _ = train(23, val_tasks=6)  # another validation: the step-0 one runs
    assert n_other == n_first
