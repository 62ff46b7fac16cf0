"""The training loop on DeepSpeed (CPU, gloo): losses move, parameters change, ZeRO stages, resume.

Each test builds a tiny LlamaForCausalLM (hidden 32, 2 layers, vocab 64). The first two-rank
DeepSpeed start in a session loads the shared-memory comm op; `make install-dev` runs
`python -m flywheel.training.prebuild` once so it is not compiled here.
"""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flywheel.checkpoint import weights_digest
from flywheel.config import TrainSection
from flywheel.store import TRAIN_STATE_DIR
from flywheel.training import data, loop
from flywheel.training.loop import LossParams, TrainResult, compute_ref_logps, deepspeed_config
from flywheel.training.losses import masked_ce, token_logprobs

REPO = Path(__file__).resolve().parents[3]


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def counting(n: int, seed: int = 0) -> list[dict]:
    """Sequences that count up by one (mod 64) from a random start: easy to learn, so the loss falls.
    The first 3 tokens are the 'prompt' (loss 0), the rest the trained 'assistant' part."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start, length = rng.randrange(64), rng.randrange(8, 20)
        ids = [(start + t) % 64 for t in range(length)]
        out.append({"input_ids": ids, "loss_mask": [0, 0, 0] + [1] * (length - 3)})
    return out


def params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().float() for p in model.parameters()])


def saved_params(out_dir: Path) -> torch.Tensor:
    return params(LlamaForCausalLM.from_pretrained(out_dir))


CFG = dict(epochs=1, lr=1e-2, warmup_ratio=0.0, micro_batch_size=4, grad_accum=1, max_length=32)
LOSS_KEYS = {"beta", "nll_weight", "clip", "kl_coef", "expert_weight"}
LOSS_DEFAULTS = {"dpo": {"beta": 0.1}, "grpo": {"clip": 0.2}}


def train(model, examples, *, loss: str, cfg: dict, **kw) -> TrainResult:
    """loop.train with one dict of knobs: the training section's, and the loss's own."""
    section = TrainSection(**{k: v for k, v in cfg.items() if k not in LOSS_KEYS})
    params = LossParams(
        **LOSS_DEFAULTS.get(loss, {}) | {k: v for k, v in cfg.items() if k in LOSS_KEYS}
    )
    return loop.train(model, examples, loss=loss, cfg=section, params=params, **kw)  # type: ignore[arg-type]


def test_sft_loss_falls_and_params_change(tmp_path: Path) -> None:
    model = tiny_model()
    before = params(model)
    cfg = dict(**CFG | {"epochs": 4, "zero_stage": 2})
    result = train(model, counting(16), loss="sft", cfg=cfg, out_dir=tmp_path)
    losses = [r["loss"] for r in result.history]
    assert result.steps == 16 and len(losses) == 16  # 16 examples / 4 per batch * 4 epochs
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-4:]) < sum(losses[:4]) - 0.5  # last epoch well below the first
    assert not torch.allclose(before, saved_params(tmp_path))
    assert torch.allclose(
        params(model), saved_params(tmp_path)
    )  # stage 2 trains the object in place
    assert not (tmp_path / TRAIN_STATE_DIR).exists()
    assert all(r["tokens"] > 0 for r in result.history)


def test_grad_accum_and_short_last_step(tmp_path: Path) -> None:
    # 5 micro-batches per epoch with grad_accum 2: steps of 2, 2 and 1 micro-batches.
    cfg = dict(**CFG | {"epochs": 2, "grad_accum": 2, "micro_batch_size": 2, "zero_stage": 0})
    result = train(tiny_model(), counting(10), loss="sft", cfg=cfg, out_dir=tmp_path)
    assert result.steps == 6
    assert [r["epoch"] for r in result.history] == [0, 0, 0, 1, 1, 1]


def test_lr_warmup_then_cosine(tmp_path: Path) -> None:
    cfg = dict(**CFG | {"warmup_ratio": 0.25, "zero_stage": 1, "lr": 1.0})
    result = train(tiny_model(), counting(32), loss="sft", cfg=cfg, out_dir=tmp_path)
    lrs = [r["lr"] for r in result.history]
    # 8 steps, warmup ceil(0.25*8) = 2: (0+1)/3, (1+1)/3, then 0.5*(1+cos(pi*k/6)) for k = 0..5.
    import math

    expected = [1 / 3, 2 / 3] + [0.5 * (1 + math.cos(math.pi * k / 6)) for k in range(6)]
    assert lrs == pytest.approx(expected)


def test_zero3_trains_and_saves_gathered_weights(tmp_path: Path) -> None:
    model = tiny_model()
    before = params(model)
    cfg = dict(**CFG | {"epochs": 2, "zero_stage": 3})
    result = train(model, counting(8), loss="sft", cfg=cfg, out_dir=tmp_path)
    assert result.steps == 4 and all(
        map(torch.isfinite, torch.tensor([r["loss"] for r in result.history]))
    )
    after = saved_params(tmp_path)
    assert after.shape == before.shape and not torch.allclose(before, after)


@pytest.mark.parametrize("stage", [2, 3])
def test_templates_fill_auto_values(stage: int) -> None:
    path = REPO / "configs" / "deepspeed" / f"zero{stage}.json"
    cfg = TrainSection(
        micro_batch_size=3,
        grad_accum=6,
        grad_clip=0.5,
        zero_stage=stage,
        deepspeed_config=str(path),
    )
    filled = deepspeed_config(cfg, world_size=2, bf16=False)
    assert "auto" not in json.dumps(filled)
    # grad_accum counts micro-batches over all ranks: 2 ranks run 3 each, 6 * 3 sequences a step.
    assert filled["train_batch_size"] == 18 and filled["gradient_accumulation_steps"] == 3
    assert filled["gradient_clipping"] == 0.5
    assert filled["zero_optimization"]["stage"] == stage and filled["bf16"] == {"enabled": False}
    with pytest.raises(ValueError, match="ZeRO stage"):
        deepspeed_config(
            TrainSection(zero_stage=1, deepspeed_config=str(path)), world_size=1, bf16=False
        )


def test_template_config_trains(tmp_path: Path) -> None:
    path = REPO / "configs" / "deepspeed" / "zero2.json"
    cfg = dict(**CFG | {"zero_stage": 2, "deepspeed_config": str(path), "max_steps": 2})
    result = train(tiny_model(), counting(16), loss="sft", cfg=cfg, out_dir=tmp_path)
    assert result.steps == 2


def pairs(n: int) -> list[dict]:
    """DPO pairs sharing a counting prompt: chosen keeps counting, rejected repeats a token."""
    out = []
    for ex in counting(n, seed=1):
        ids = ex["input_ids"]
        rejected = ids[:4] + [ids[3]] * (len(ids) - 4)
        mask = [0] * 4 + [1] * (len(ids) - 4)
        out.append(
            {
                "chosen_ids": ids,
                "chosen_mask": mask,
                "rejected_ids": rejected,
                "rejected_mask": mask,
            }
        )
    return out


def test_dpo_with_reference_model(tmp_path: Path) -> None:
    model = tiny_model()
    before = params(model)
    cfg = dict(**CFG | {"epochs": 3, "zero_stage": 2, "beta": 0.5})
    result = train(
        model, pairs(8), loss="dpo", cfg=cfg, out_dir=tmp_path, ref_model=copy.deepcopy(model)
    )
    first = result.history[0]
    # Policy == reference on the first step: margin 0, loss = -log sigmoid(0) = log 2.
    assert first["loss"] == pytest.approx(0.693147, abs=1e-4)
    assert first["chosen_reward"] == pytest.approx(0.0, abs=1e-5)
    assert result.history[-1]["loss"] < first["loss"]
    assert not torch.allclose(before, saved_params(tmp_path))


def test_dpo_with_precomputed_reference(tmp_path: Path) -> None:
    model = tiny_model()
    examples = pairs(8)
    chosen, rejected = compute_ref_logps(model, examples, batch_size=3, max_length=32)
    assert len(chosen) == 8 and all(c < 0 for c in chosen)
    examples = [
        ex | {"ref_chosen_logp": c, "ref_rejected_logp": r}
        for ex, c, r in zip(examples, chosen, rejected, strict=True)
    ]
    cfg = dict(**CFG | {"epochs": 2, "zero_stage": 2})
    result = train(model, examples, loss="dpo", cfg=cfg, out_dir=tmp_path)
    assert result.history[0]["loss"] == pytest.approx(0.693147, abs=1e-4)
    assert all(torch.isfinite(torch.tensor([r["loss"] for r in result.history])))


def test_dpo_nll_weight_adds_the_chosen_token_mean_nll() -> None:

    model = tiny_model()
    examples = pairs(4)
    chosen, rejected = compute_ref_logps(model, examples, batch_size=4, max_length=32)
    examples = [
        ex | {"ref_chosen_logp": c, "ref_rejected_logp": r}
        for ex, c, r in zip(examples, chosen, rejected, strict=True)
    ]
    batch = data.collate(examples, "dpo")
    plain, _ = loop._batch_loss(model, batch, "dpo", LossParams(beta=0.5), None)
    mixed, stats = loop._batch_loss(model, batch, "dpo", LossParams(beta=0.5, nll_weight=2.0), None)
    with torch.no_grad():
        logits = model(
            input_ids=batch["chosen_ids"], attention_mask=batch["chosen_attention_mask"]
        ).logits
        nll = masked_ce(logits, batch["chosen_ids"], batch["chosen_mask"])
    # Policy == reference: the DPO part is log 2; the weighted NLL comes on top.
    assert plain.item() == pytest.approx(0.693147, abs=1e-4)
    assert mixed.item() == pytest.approx(plain.item() + 2.0 * nll.item(), rel=1e-4)
    assert stats["chosen_nll"].item() == pytest.approx(nll.item(), rel=1e-4)


def test_missing_reference_is_a_clear_error(tmp_path: Path) -> None:
    model, cfg = tiny_model(), dict(**CFG)
    with pytest.raises(
        ValueError, match="dpo needs ref_chosen_logp on the examples or a ref_model"
    ):
        train(model, pairs(2), loss="dpo", cfg=cfg, out_dir=tmp_path)
    with pytest.raises(ValueError, match="not the policy itself"):
        train(model, pairs(2), loss="dpo", cfg=cfg, out_dir=tmp_path, ref_model=model)
    grpo = [
        ex | {"old_logprobs": [0.0] * len(ex["input_ids"]), "advantage": 1.0} for ex in counting(2)
    ]
    with pytest.raises(ValueError, match="grpo needs ref_logprobs"):
        train(model, grpo, loss="grpo", cfg=dict(**CFG | {"kl_coef": 0.1}), out_dir=tmp_path)


def rollouts(model: torch.nn.Module, n: int) -> list[dict]:
    """GRPO examples whose behaviour log-probs come from `model` itself, so the first ratio is 1."""
    out = []
    for i, ex in enumerate(counting(n, seed=2)):
        ids = torch.tensor([ex["input_ids"]])
        with torch.no_grad():
            lp = token_logprobs(model(input_ids=ids).logits, ids)[0].tolist()
        old = [0.0] + [v if m else 0.0 for v, m in zip(lp, ex["loss_mask"][1:], strict=True)]
        out.append(
            ex | {"old_logprobs": old, "advantage": 1.0 if i % 2 else -1.0, "ref_logprobs": old}
        )
    return out


def test_grpo_trains(tmp_path: Path) -> None:
    model = tiny_model()
    before = params(model)
    cfg = dict(**CFG | {"epochs": 2, "zero_stage": 2, "kl_coef": 0.1, "lr": 1e-3})
    result = train(model, rollouts(model, 8), loss="grpo", cfg=cfg, out_dir=tmp_path)
    first = result.history[0]
    assert first["ratio"] == pytest.approx(1.0, abs=1e-4) and first["kl"] == pytest.approx(
        0.0, abs=1e-6
    )
    assert all(torch.isfinite(torch.tensor([r["loss"] for r in result.history])))
    assert result.history[-1]["kl"] > 0  # the policy moved away from the reference
    assert not torch.allclose(before, saved_params(tmp_path))


def test_mix_batch_trains_expert_rows_by_nll_only(tmp_path: Path) -> None:
    # Two policy rows (advantages +-1) and two expert rows with a huge advantage that must be ignored.
    model = tiny_model()
    policy_rows = [ex | {"expert": 0.0} for ex in rollouts(model, 2)]
    expert_rows = [
        ex | {"old_logprobs": [0.0] * len(ex["input_ids"]), "advantage": 100.0, "expert": 1.0,
              "ref_logprobs": [0.0] * len(ex["input_ids"])}
        for ex in counting(2, seed=5)
    ]  # fmt: skip
    cfg = LossParams(clip=0.2, expert_weight=0.3)
    batch = data.collate(policy_rows + expert_rows, "grpo")
    with torch.no_grad():
        value, stats = loop._batch_loss(model, batch, "grpo", cfg, None)
        only_policy, _ = loop._batch_loss(
            model, data.collate(policy_rows, "grpo"), "grpo", cfg, None
        )
        experts = data.collate(expert_rows, "grpo")
        logits = model(input_ids=experts["input_ids"]).logits
        nll = masked_ce(logits, experts["input_ids"], experts["loss_mask"])
    # Policy rows alone hold no expert row, so their value is 0.7 * GRPO; the mixed batch adds 0.3 * NLL.
    assert value.item() == pytest.approx(only_policy.item() + 0.3 * nll.item(), rel=1e-4)
    assert stats["expert_nll"].item() == pytest.approx(nll.item(), rel=1e-4)
    with pytest.raises(ValueError, match="expert rows but expert_weight is 0"):
        train(model, policy_rows + expert_rows, loss="grpo", cfg=dict(**CFG), out_dir=tmp_path)


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_matches_uninterrupted_run(tmp_path: Path, stage: int) -> None:
    # 12 examples / 2 per batch = 6 batches, grad_accum 2 -> 3 steps per epoch, 2 epochs = 6 steps.
    # Checkpoints after steps 2 and 4 (the second one crosses an epoch boundary mid-way).
    cfg = dict(
        **CFG
        | {
            "epochs": 2,
            "micro_batch_size": 2,
            "grad_accum": 2,
            "zero_stage": stage,
            "checkpoint_every": 2,
        }
    )
    examples = counting(12, seed=3)
    straight = train(tiny_model(), examples, loss="sft", cfg=cfg, out_dir=tmp_path / "straight")

    class Crash(Exception):
        pass

    def crash_at_5(record: dict) -> None:
        if record["step"] == 5:
            raise Crash

    with pytest.raises(Crash):
        train(
            tiny_model(),
            examples,
            loss="sft",
            cfg=cfg,
            out_dir=tmp_path / "resumed",
            log=crash_at_5,
        )
    assert (tmp_path / "resumed" / TRAIN_STATE_DIR / "latest").read_text().strip() == "step4"
    resumed = train(tiny_model(seed=7), examples, loss="sft", cfg=cfg, out_dir=tmp_path / "resumed")
    assert resumed.steps == 6 and len(resumed.history) == 6
    assert [r["loss"] for r in resumed.history] == pytest.approx(
        [r["loss"] for r in straight.history]
    )
    assert torch.allclose(saved_params(tmp_path / "straight"), saved_params(tmp_path / "resumed"))


def test_checkpoint_due_by_steps_and_by_time() -> None:
    by_steps = TrainSection(checkpoint_every=3, checkpoint_minutes=0)
    assert [s for s in range(1, 10) if loop._checkpoint_due(by_steps, s, 1e9, 1)] == [3, 6, 9]
    by_time = TrainSection(checkpoint_minutes=2)  # checkpoint_every 0: time alone
    assert not loop._checkpoint_due(by_time, 5, 119.0, 1)
    assert loop._checkpoint_due(by_time, 5, 120.0, 1)
    assert not loop._checkpointing(TrainSection(checkpoint_minutes=0))
    assert TrainSection().checkpoint_minutes == 15  # on by default: a killed step resumes


def test_resume_from_a_state_saved_by_time(tmp_path: Path) -> None:
    # A tiny checkpoint_minutes saves after every step; the log callback runs after the save, so
    # a crash there at step 5 leaves step 5's state.
    cfg = CFG | {"epochs": 2, "micro_batch_size": 2, "grad_accum": 2, "checkpoint_minutes": 1e-9}
    examples = counting(12, seed=3)
    train(tiny_model(), examples, loss="sft", cfg=cfg, out_dir=tmp_path / "straight")

    def crash_at_5(record: dict) -> None:
        if record["step"] == 5:
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        train(tiny_model(), examples, loss="sft", cfg=cfg, out_dir=tmp_path / "r", log=crash_at_5)
    assert (tmp_path / "r" / TRAIN_STATE_DIR / "latest").read_text().strip() == "step5"
    resumed = train(tiny_model(seed=7), examples, loss="sft", cfg=cfg, out_dir=tmp_path / "r")
    assert resumed.steps == 6
    assert torch.allclose(saved_params(tmp_path / "straight"), saved_params(tmp_path / "r"))
    assert not (tmp_path / "r" / TRAIN_STATE_DIR).exists()  # deleted once the model is saved


def test_resume_refuses_a_different_run(tmp_path: Path) -> None:
    cfg = dict(**CFG | {"checkpoint_every": 1, "zero_stage": 0})

    def crash(record: dict) -> None:
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError):
        train(tiny_model(), counting(8), loss="sft", cfg=cfg, out_dir=tmp_path, log=crash)
    with pytest.raises(ValueError, match="different run"):
        train(
            tiny_model(),
            counting(8),
            loss="sft",
            cfg=dict(**CFG | {"checkpoint_every": 1, "zero_stage": 0, "lr": 0.5}),
            out_dir=tmp_path,
        )


TWO_RANK_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_loop import tiny_model, counting, params
from flywheel.config import SftConfig, TrainSection
from flywheel.training.loop import train
model = tiny_model()
cfg = {section}
result = train(model, counting({n}), loss="sft", cfg=cfg, out_dir={out!r})
rank = torch.distributed.get_rank()
torch.save({{"params": params(model), "steps": result.steps}}, {out!r} + f"/rank{{rank}}.pt")
"""


def two_rank_run(tmp_path: Path, section: str, n: int, timeout: int) -> list[dict]:
    """Train counting(n) with the training section `section` (Python source) on 2 CPU ranks
    under the deepspeed launcher; each rank's final params and step count."""
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "two_ranks.py"
    tests = str(Path(__file__).parent)
    script.write_text(TWO_RANK_SCRIPT.format(tests=tests, out=str(out), section=section, n=n))
    launcher = Path(sys.executable).parent / "deepspeed"
    env = os.environ | {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [str(launcher), "--num_accelerators", "2", "--master_port", str(loop._free_port()), str(script)],
        env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt") for r in (0, 1)]


@pytest.mark.slow
def test_two_ranks_with_deepspeed_launcher(tmp_path: Path) -> None:
    start = time.perf_counter()
    section = (
        "TrainSection(epochs=2, lr=1e-2, warmup_ratio=0.0, micro_batch_size=2, grad_accum=2, "
        "max_length=32, zero_stage=2)"
    )
    ranks = two_rank_run(tmp_path, section, n=9, timeout=300)
    # 9 examples -> 5 batches, padded to 6 by wrapping; 3 per rank per epoch; grad_accum 2 is one
    # per rank per step: 3 steps per epoch, 2 epochs.
    assert ranks[0]["steps"] == ranks[1]["steps"] == 6
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
    assert torch.allclose(ranks[0]["params"], saved_params(tmp_path / "out"))
    print(f"2-rank launcher run: {time.perf_counter() - start:.1f} s")


@pytest.mark.slow
def test_two_ranks_with_length_split_take_as_many_passes(tmp_path: Path) -> None:
    """7 examples in micro-batches of 3: an epoch's last holds one example, which one rank runs
    while the other runs three. With length_split 3 both still run three backward passes that
    step (ZeRO-2 reduces in each; unequal counts would hang), and end with equal weights."""
    section = (
        "SftConfig(epochs=2, lr=1e-2, warmup_ratio=0.0, micro_batch_size=3, grad_accum=2, "
        "max_length=32, zero_stage=2, length_split=3)"
    )
    # A hang fails at the timeout; 300 s as above, since at 120 the launcher's start alone ran
    # past it once with another training job at full priority on both cores.
    ranks = two_rank_run(tmp_path, section, n=7, timeout=300)
    assert ranks[0]["steps"] == ranks[1]["steps"] == 4  # 3 batches padded to 4: 2 steps an epoch
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
    assert not torch.allclose(ranks[0]["params"], params(tiny_model()))


def test_one_process_does_not_build_the_shared_memory_op(tmp_path: Path) -> None:
    """A single-process group keeps DeepSpeed from building its shared-memory all-reduce op (g++,
    30-60 s in a fresh environment, for collectives one process never runs) and leaves DeepSpeed's
    table of compatible ops as it found it. An empty extensions folder: a build would land there."""
    script = (
        "import deepspeed.comm.comm as comm, deepspeed.ops\n"
        "from flywheel.training import loop\n"
        "before = dict(deepspeed.ops.__compatible_ops__)\n"
        "assert before['deepspeed_shm_comm'], before  # the op is there to skip\n"
        "assert loop.init_distributed() == (0, 1)\n"
        "assert comm.cdb.shm_comm_op is None, 'the shm op was loaded'\n"
        "assert deepspeed.ops.__compatible_ops__ == before\n"
    )
    extensions = tmp_path / "torch_extensions"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    # The CPU accelerator even where a GPU is present: the op and its skip are the CPU path's.
    env |= {"TORCH_EXTENSIONS_DIR": str(extensions), "DS_ACCELERATOR": "cpu"}
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert not extensions.exists() or not any(extensions.iterdir())


def test_early_stopping_keeps_the_best_validated_weights(tmp_path: Path) -> None:
    # A hand-made validation curve at steps 0, 2, 4, ...: best at step 4, then three validations
    # without improvement (steps 6, 8, 10) use up patience 3, so training stops after step 10.
    curve = iter([0.1, 0.3, 0.5, 0.4, 0.45, 0.2, 0.9])
    seen: dict[int, torch.Tensor] = {}

    def validate(module: torch.nn.Module) -> dict[str, float]:
        seen[2 * len(seen)] = params(module).clone()
        score = next(curve)
        return {"score": score, "val_made_up": score}

    cfg = CFG | {"epochs": 50, "val_every": 2, "patience": 3}
    result = train(
        tiny_model(), counting(16), loss="sft", cfg=cfg, out_dir=tmp_path, validate=validate
    )
    assert (result.steps, result.best_step, result.best_score) == (10, 4, 0.5)
    assert result.stopped_early and result.stop_reason == "patience"
    assert sorted(seen) == [0, 2, 4, 6, 8, 10]
    assert torch.equal(saved_params(tmp_path), seen[4])  # the kept weights are step 4's
    assert not torch.equal(seen[4], seen[10])
    assert not (tmp_path / loop.BEST_DIR).exists()
    validated = [h for h in result.history if "val_score" in h]
    assert [h["step"] for h in validated] == [0, 2, 4, 6, 8, 10]
    assert validated[2]["val_made_up"] == 0.5


def test_a_run_that_keeps_step_0_saves_its_start_byte_for_byte(tmp_path: Path) -> None:
    """No validation beats step 0: the saved weights are the start's, file for file, so the
    checkpoint has its parent's weights_sha256 (and an evaluation of the parent can be reused)."""
    model = tiny_model()
    model.save_pretrained(tmp_path / "start")
    curve = iter([0.5, 0.1, 0.2])
    cfg = CFG | {"epochs": 50, "val_every": 1, "patience": 2}
    out = tmp_path / "out"
    result = train(
        model, counting(8), loss="sft", cfg=cfg, out_dir=out,
        validate=lambda m: {"score": next(curve)},
    )  # fmt: skip
    assert (result.steps, result.best_step) == (2, 0)
    assert list(out.glob("*.safetensors")) and list((tmp_path / "start").glob("*.safetensors"))
    assert weights_digest(out) == weights_digest(tmp_path / "start")


# Validation scores by step for the lr-drop tests: best at step 2, then two worse validations
# (patience 2) at steps 4 and 6 -> back to step 2's weights at a tenth of the lr; step 8 is a
# new best, steps 10 and 12 use up patience again and no drop is left.
DROP_CURVE = {0: 0.1, 2: 0.5, 4: 0.4, 6: 0.3, 8: 0.6, 10: 0.2, 12: 0.2}
DROP_CFG = CFG | {
    "epochs": 50, "schedule": "constant", "val_every": 2, "patience": 2, "lr_drops": 1,
    "lr_drop_factor": 0.1,
}  # fmt: skip


def scripted(steps: list[int], seen: dict[int, torch.Tensor]):
    """A validate callback that returns DROP_CURVE's score for each step in `steps`, in turn,
    and keeps the weights it was shown."""
    order = iter(steps)

    def validate(module: torch.nn.Module) -> dict[str, float]:
        step = next(order)
        seen[step] = params(module).clone()
        return {"score": DROP_CURVE[step]}

    return validate


@pytest.mark.parametrize("stage", [0, 2])
def test_plateau_drops_the_lr_and_restarts_from_the_best_weights(
    tmp_path: Path, stage: int
) -> None:
    seen: dict[int, torch.Tensor] = {}
    result = train(
        tiny_model(), counting(16), loss="sft", cfg=DROP_CFG | {"zero_stage": stage},
        out_dir=tmp_path, validate=scripted(sorted(DROP_CURVE), seen),
    )  # fmt: skip
    assert (result.steps, result.best_step, result.stop_reason) == (12, 8, "patience")
    assert result.lr_drop_steps == [6]
    lrs = {h["step"]: h["lr"] for h in result.history if "lr" in h}
    assert [lrs[s] for s in (1, 6)] == pytest.approx([1e-2, 1e-2])
    assert [lrs[s] for s in (7, 8, 12)] == pytest.approx([1e-3, 1e-3, 1e-3])
    # Steps 7 and 8 started from step 2's weights with fresh Adam moments: each moves every
    # weight by about the lr (1e-3); going on from step 6's weights would be 10x further away.
    assert (seen[6] - seen[2]).abs().max() > 1e-2
    assert (seen[8] - seen[2]).abs().max() < 3e-3
    assert torch.equal(saved_params(tmp_path), seen[8])


def test_no_drop_left_stops_at_the_first_plateau(tmp_path: Path) -> None:
    seen: dict[int, torch.Tensor] = {}
    result = train(
        tiny_model(), counting(16), loss="sft", cfg=DROP_CFG | {"lr_drops": 0},
        out_dir=tmp_path, validate=scripted(sorted(DROP_CURVE), seen),
    )  # fmt: skip
    assert (result.steps, result.best_step, result.lr_drop_steps) == (6, 2, [])


def test_resume_after_an_lr_drop_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    cfg = DROP_CFG | {"checkpoint_every": 1}
    steps = sorted(DROP_CURVE)
    straight = train(
        tiny_model(), counting(16), loss="sft", cfg=cfg, out_dir=tmp_path / "straight",
        validate=scripted(steps, {}),
    )  # fmt: skip

    class Crash(Exception):
        pass

    def crash_at_9(record: dict) -> None:
        if record["step"] == 9:
            raise Crash

    with pytest.raises(Crash):
        train(
            tiny_model(), counting(16), loss="sft", cfg=cfg, out_dir=tmp_path / "resumed",
            validate=scripted([s for s in steps if s <= 8], {}), log=crash_at_9,
        )  # fmt: skip
    resumed = train(
        tiny_model(seed=7), counting(16), loss="sft", cfg=cfg, out_dir=tmp_path / "resumed",
        validate=scripted([s for s in steps if s > 9], {}),
    )  # fmt: skip
    assert resumed.lr_drop_steps == straight.lr_drop_steps == [6]
    assert [r["lr"] for r in resumed.history if "lr" in r][-4:] == pytest.approx([1e-3] * 4)
    assert [r["loss"] for r in resumed.history if "loss" in r] == pytest.approx(
        [r["loss"] for r in straight.history if "loss" in r]
    )
    assert torch.allclose(saved_params(tmp_path / "straight"), saved_params(tmp_path / "resumed"))


def test_resume_after_an_improvement_past_the_last_periodic_save(tmp_path: Path) -> None:
    # Periodic saves at steps 5 and 10; the plateau at step 6 reloads the best weights, and
    # step 8 is a new best. A crash at step 9 resumed from step 5 would reload step 8's
    # weights at step 6 (the best folder lives outside the train state), so every improvement
    # also saves the state: the run resumes from step 8.
    cfg = DROP_CFG | {"checkpoint_every": 5, "checkpoint_minutes": 0}
    steps = sorted(DROP_CURVE)
    straight = train(
        tiny_model(), counting(16), loss="sft", cfg=cfg, out_dir=tmp_path / "straight",
        validate=scripted(steps, {}),
    )  # fmt: skip

    def crash_at_9(record: dict) -> None:
        if record["step"] == 9:
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        train(
            tiny_model(), counting(16), loss="sft", cfg=cfg, out_dir=tmp_path / "resumed",
            validate=scripted([s for s in steps if s <= 8], {}), log=crash_at_9,
        )  # fmt: skip
    assert (tmp_path / "resumed" / TRAIN_STATE_DIR / "latest").read_text().strip() == "step8"
    resumed = train(
        tiny_model(seed=7), counting(16), loss="sft", cfg=cfg, out_dir=tmp_path / "resumed",
        validate=scripted([s for s in steps if s > 8], {}),
    )  # fmt: skip
    assert (resumed.best_step, resumed.lr_drop_steps) == (straight.best_step, [6])
    assert torch.allclose(saved_params(tmp_path / "straight"), saved_params(tmp_path / "resumed"))


def test_min_delta_counts_small_gains_as_no_improvement(tmp_path: Path) -> None:
    curve = iter([0.1, 0.15, 0.19, 0.5])
    cfg = CFG | {"epochs": 50, "val_every": 1, "patience": 2, "min_delta": 0.1}
    result = train(
        tiny_model(), counting(8), loss="sft", cfg=cfg, out_dir=tmp_path,
        validate=lambda m: {"score": next(curve)},
    )  # fmt: skip
    assert (result.steps, result.best_step, result.stop_reason) == (2, 0, "patience")


def test_token_budget_stops_training(tmp_path: Path) -> None:
    examples = counting(16)
    result = train(
        tiny_model(),
        examples,
        loss="sft",
        cfg=CFG | {"epochs": 10},
        out_dir=tmp_path,
        max_tokens=100,
    )
    per_step = [h["tokens"] for h in result.history]
    assert result.stop_reason == "tokens" and result.tokens == sum(per_step)
    assert sum(per_step[:-1]) < 100 <= result.tokens
    assert result.steps < 10 * 4


def test_validation_loss_is_the_token_mean_masked_ce() -> None:
    model, examples = tiny_model(), counting(5)
    got = loop.validation_loss(model, examples, batch_size=2, max_length=32)
    batch = data.collate(examples, "sft")
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        want = masked_ce(logits, batch["input_ids"], batch["loss_mask"]).item()
    assert got == pytest.approx(want, rel=1e-4)


def test_the_step_that_spends_the_token_budget_is_validated(tmp_path: Path) -> None:
    seen: list[int] = []

    def validate(module: torch.nn.Module) -> dict[str, float]:
        seen.append(len(seen))
        return {"score": float(len(seen))}  # every validation better than the last

    cfg = CFG | {"epochs": 10, "val_every": 50}
    result = train(
        tiny_model(), counting(16), loss="sft", cfg=cfg, out_dir=tmp_path, max_tokens=100,
        validate=validate,
    )  # fmt: skip
    assert result.stop_reason == "tokens" and result.steps < 50
    assert len(seen) == 2 and result.best_step == result.steps  # step 0, then the last step


def test_length_slices_give_the_micro_batch_loss_and_gradient() -> None:
    examples = counting(11, seed=3)
    examples.append({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 0, 0]})  # nothing trained
    slices = loop.length_slices(examples, "sft", 3)
    assert sorted(len(ex["input_ids"]) for piece, _ in slices for ex in piece) == sorted(
        len(ex["input_ids"]) for ex in examples
    )
    lengths = [[len(ex["input_ids"]) for ex in piece] for piece, _ in slices]
    assert all(a == sorted(a) for a in lengths) and lengths == sorted(lengths)
    assert len(slices) == 3 and sum(w for _, w in slices) == pytest.approx(1.0)
    padded = sum(max(row) * len(row) for row in lengths)
    assert padded < max(map(max, lengths)) * len(examples)  # the point: less padding

    def loss_and_grad(pieces: list[tuple[list[dict], float]]) -> tuple[float, torch.Tensor]:
        model = tiny_model()
        total = 0.0
        for piece, weight in pieces:
            batch = data.collate(piece, "sft")
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            value = masked_ce(logits.logits, batch["input_ids"], batch["loss_mask"]) * weight
            value.backward()
            total += value.item()
        return total, torch.cat([p.grad.flatten() for p in model.parameters()])

    whole_loss, whole_grad = loss_and_grad([(examples, 1.0)])
    split_loss, split_grad = loss_and_grad(slices)
    assert split_loss == pytest.approx(whole_loss, rel=1e-6)
    assert torch.allclose(split_grad, whole_grad, atol=1e-6, rtol=1e-4)
    # Weighting each slice equally instead would not give the same gradient.
    _, equal_grad = loss_and_grad([(piece, 1 / len(slices)) for piece, _ in slices])
    assert not torch.allclose(equal_grad, whole_grad, atol=1e-6, rtol=1e-4)
    assert loop.length_slices(examples, "sft", 1) == [(examples, 1.0)]
    # Fewer examples than slices (an epoch's last micro-batch): still 3 passes, the extra ones
    # at weight 0, so every rank runs as many backward passes a step.
    short = loop.length_slices(examples[:1], "sft", 3)
    assert [len(piece) for piece, _ in short] == [1, 1, 1]
    assert [w for _, w in short] == [0.0, 0.0, 1.0]


def test_training_in_length_slices_matches_one_pass_per_micro_batch(tmp_path: Path) -> None:
    from flywheel.config import SftConfig

    runs = {}
    for split in (1, 3):
        cfg = SftConfig(**CFG | {"epochs": 3, "micro_batch_size": 6, "length_split": split})
        model = tiny_model()
        runs[split] = (
            loop.train(model, counting(20), loss="sft", cfg=cfg, out_dir=tmp_path / str(split)),
            params(model),
        )
    (one, w1), (three, w3) = runs[1], runs[3]
    # 20 examples in micro-batches of 6: each epoch's last holds 2, run as 3 passes (one of them
    # a repeat at weight 0, which trains nothing and counts no token).
    assert one.steps == three.steps == 12
    assert [r["tokens"] for r in one.history] == [r["tokens"] for r in three.history]
    assert [r["loss"] for r in three.history] == pytest.approx(
        [r["loss"] for r in one.history], rel=1e-4
    )
    assert not torch.allclose(w1, params(tiny_model()))  # it trained
    # Rounding only: Adam turns rounding-level gradient differences into lr-sized steps where a
    # gradient is near 0, so at lr 1e-2 the weights drift about 1e-5 every few steps (6e-5 here
    # after 12); slices weighted equally instead of by trained tokens move them by 1e-2.
    assert torch.allclose(w3, w1, atol=2e-4)


def test_length_split_is_for_the_sft_loss_only(tmp_path: Path) -> None:
    from flywheel.config import SftConfig

    pair = {"chosen_ids": [1, 2, 3], "chosen_mask": [0, 1, 1]}
    pair |= {"rejected_ids": [1, 2, 4], "rejected_mask": [0, 1, 1]}
    pair |= {"ref_chosen_logp": -1.0, "ref_rejected_logp": -1.0}
    with pytest.raises(ValueError, match="length_split applies to the sft loss only, not dpo"):
        loop.train(
            tiny_model(), [pair] * 4, loss="dpo", cfg=SftConfig(**CFG | {"length_split": 2}),
            out_dir=tmp_path, params=LossParams(beta=0.1),
        )  # fmt: skip
    assert not any(tmp_path.iterdir())


def test_known_start_numbers_replace_the_validation_before_the_first_step(tmp_path: Path) -> None:
    """start_validation: the numbers of the starting weights are taken, not measured; they
    count as step 0's validation (here the best, so the start's weights are what is saved)."""
    model = tiny_model()
    model.save_pretrained(tmp_path / "start")
    seen: list[int] = []

    def validate(module: torch.nn.Module) -> dict[str, float]:
        seen.append(len(seen))
        return {"score": 0.5, "val_success": 0.5}

    cfg = CFG | {"epochs": 1, "val_every": 2, "patience": 5}
    out = tmp_path / "out"
    result = train(
        model, counting(16), loss="sft", cfg=cfg, out_dir=out, validate=validate,
        start_validation={"score": 0.9, "val_success": 0.9},
    )  # fmt: skip
    assert result.steps == 4 and len(seen) == 2  # after steps 2 and 4 only
    assert result.history[0] == {"step": 0, "val_score": 0.9, "val_success": 0.9}
    assert (result.best_step, result.best_score) == (0, 0.9)
    assert weights_digest(out) == weights_digest(tmp_path / "start")


def linear_output_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    """Records the dtype of every Linear layer's output while the model trains (a forward hook)."""
    seen: set[torch.dtype] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
    return seen


@pytest.mark.parametrize("loss", ["sft", "dpo"])
def test_cpu_bf16_runs_the_training_forward_under_bf16_autocast(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loss: str
) -> None:
    """cpu_bf16: the layers compute in bf16, the weights stay float32, and the run learns what the
    float32 run learns, to bf16 rounding. Run on any CPU: host_info is told the CPU has bf16
    instructions (torch emulates them where it has not; the refusal is tested below)."""
    host = loop.host_info()
    monkeypatch.setattr(loop, "host_info", lambda: host | {"cpu_flags": ["avx512_bf16"]})
    examples = counting(16) if loss == "sft" else pairs(16)
    cfg = CFG | {"epochs": 2} | ({"nll_weight": 0.0} if loss == "dpo" else {})
    runs = {}
    for cpu_bf16 in (False, True):
        model = tiny_model()
        ref = tiny_model() if loss == "dpo" else None
        seen = linear_output_dtypes(model)
        out = tmp_path / str(cpu_bf16)
        result = train(
            model, examples, loss=loss, cfg=cfg | {"cpu_bf16": cpu_bf16}, out_dir=out, ref_model=ref
        )
        assert seen == ({torch.bfloat16} if cpu_bf16 else {torch.float32})
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        runs[cpu_bf16] = ([r["loss"] for r in result.history], saved_params(out))
    (loss32, w32), (loss16, w16) = runs[False], runs[True]
    assert len(loss32) == len(loss16) == 8
    assert max(abs(a - b) for a, b in zip(loss32, loss16, strict=True)) < 0.05
    assert not torch.equal(w32, w16)  # other rounding: other weights
    # ... close to the float32 run's, against how far training moved them.
    moved = (w32 - params(tiny_model())).norm()
    assert (w32 - w16).norm() < 0.15 * moved  # 0.06-0.07 measured


def test_cpu_bf16_is_refused_on_a_cpu_without_bf16_instructions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = loop.host_info()
    monkeypatch.setattr(
        loop, "host_info", lambda: host | {"cpu": "Old CPU", "cpu_flags": ["avx2", "avx512f"]}
    )
    with pytest.raises(ValueError, match=r"cpu_bf16: this CPU \(Old CPU\) has neither"):
        train(tiny_model(), counting(8), loss="sft", cfg=CFG | {"cpu_bf16": True}, out_dir=tmp_path)
    assert not any(tmp_path.iterdir())
    # Off, the flags are not read and the run trains in float32.
    result = train(tiny_model(), counting(8), loss="sft", cfg=CFG, out_dir=tmp_path / "off")
    assert result.steps == 2
