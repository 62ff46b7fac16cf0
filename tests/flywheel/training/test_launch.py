"""Multi-rank training through run_training: the launcher command, hostfile checks, ZeRO
templates named from a YAML, rank settings left out of artifact ids, and SFT on 2 CPU ranks
(gloo) ending where the 1-rank run ends.

The 2-rank test starts the deepspeed launcher (two Python processes importing torch,
transformers and DeepSpeed): 15-20 s on 2 busy cores, most of it the ranks' imports.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

import stages.dpo
import stages.grpo
import stages.rft
import stages.sft
import stages.sft_more
from flywheel.config import Config, ConfigError, TrainSection, load_config
from flywheel.training import launch
from flywheel.training.launch import launch_command, rank_count, run_training
from flywheel.training.loop import TrainResult, deepspeed_config, validation_loss
from tests.flywheel.training.test_loop import counting, saved_params, tiny_model

REPO = Path(__file__).resolve().parents[3]


def test_launcher_command_for_ranks_on_this_machine(tmp_path: Path) -> None:
    cfg = TrainSection(world_size=2, grad_accum=2)
    command = launch_command(cfg, tmp_path, 29511)
    assert command == [
        str(Path(sys.executable).parent / "deepspeed"), "--num_accelerators", "2",
        "--master_port", "29511", "--no_local_rank", "--module", "flywheel.training.launch",
        str(tmp_path.resolve()),
    ]  # fmt: skip
    assert rank_count(cfg) == 2


def test_launcher_command_for_a_hostfile(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two machines\nworker-0 slots=4\nworker-1 slots=4  # the second\n")
    cfg = TrainSection(hostfile=str(hostfile), grad_accum=16)
    command = launch_command(cfg, tmp_path / "spec", 29512)
    assert command[1:3] == ["--hostfile", str(hostfile.resolve())]
    assert "--num_accelerators" not in command
    assert rank_count(cfg) == 8  # the slots decide, not world_size


def test_hostfile_errors_are_one_line_config_errors(tmp_path: Path) -> None:
    missing = TrainSection(hostfile=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"^config error: hostfile: no such file .*nope$"):
        rank_count(missing)
    # run_training refuses before it writes or trains anything
    with pytest.raises(ConfigError, match="no such file"):
        run_training(
            tiny_model(), counting(4), model_dir=tmp_path, loss="sft", cfg=missing,
            out_dir=tmp_path / "out",
        )  # fmt: skip
    assert not (tmp_path / "out").exists()
    bad = tmp_path / "bad"
    bad.write_text("worker-0 4\n")
    with pytest.raises(ConfigError, match="expected 'host slots=N'"):
        rank_count(TrainSection(hostfile=str(bad)))
    uneven = tmp_path / "uneven"
    uneven.write_text("worker-0 slots=4\n")
    with pytest.raises(ConfigError, match=r"grad_accum \(2\) must be a multiple"):
        rank_count(TrainSection(hostfile=str(uneven), grad_accum=2))


def test_grad_accum_must_split_over_the_ranks() -> None:
    with pytest.raises(ConfigError, match=r"^config error: sft: grad_accum \(3\) must be a multiple of world_size \(2\)"):  # fmt: skip
        load_config(None, ["sft.world_size=2", "sft.grad_accum=3"])
    assert load_config(None, ["sft.world_size=2", "sft.grad_accum=4"]).sft.world_size == 2


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_template_named_in_a_yaml_is_used(
    stage: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "c.yaml").write_text(
        f"sft:\n  zero_stage: {stage}\n  deepspeed_config: configs/deepspeed/zero{stage}.json\n"
        "  micro_batch_size: 2\n  grad_accum: 8\n  world_size: 4\n"
    )
    # Not the checkout: the template is found relative to it all the same.
    monkeypatch.chdir(tmp_path)
    cfg = load_config("c.yaml")
    assert cfg.sft.deepspeed_template() == REPO / "configs" / "deepspeed" / f"zero{stage}.json"
    filled = deepspeed_config(cfg.sft, world_size=4, bf16=True)
    assert filled["zero_optimization"]["stage"] == stage
    assert filled["zero_optimization"]["overlap_comm"] is True  # from the template, not the base
    if stage == 3:
        assert filled["zero_optimization"]["stage3_prefetch_bucket_size"] == 50_000_000
    assert filled["bf16"] == {"enabled": True}
    # 8 micro-batches of 2 per step over 4 ranks: 2 each, a global batch of 16.
    assert (filled["train_batch_size"], filled["gradient_accumulation_steps"]) == (16, 2)


def test_a_missing_template_is_a_one_line_error(tmp_path: Path) -> None:
    cfg = TrainSection(deepspeed_config=str(tmp_path / "zero9.json"))
    with pytest.raises(ValueError, match=r"^deepspeed_config: no such file .*zero9.json$"):
        deepspeed_config(cfg, world_size=1, bf16=False)


def test_gpu_7b_preset_fills_its_templates() -> None:
    cfg = load_config(REPO / "configs" / "gpu-7b.yaml")
    for name in ("sft", "dpo", "grpo", "sft_more", "rft"):
        section = getattr(cfg, name)
        assert (section.world_size, section.zero_stage, section.bf16) == (8, 3, True), name
        filled = deepspeed_config(section, world_size=section.world_size, bf16=True)
        assert filled["zero_optimization"]["stage"] == 3
        assert filled["train_batch_size"] == section.micro_batch_size * section.grad_accum


def test_rank_settings_are_not_part_of_artifact_ids(tmp_path: Path) -> None:
    hostfile = str(tmp_path / "hosts")
    ids = {
        "sft": lambda c: stages.sft.artifact_config(c, 1),
        "dpo": lambda c: stages.dpo.artifact_config(c, 1),
        "grpo": lambda c: stages.grpo.artifact_config(c, 1),
        "rft": stages.rft.artifact_config,
        "sft_more": stages.sft_more.artifact_config,
    }
    base = Config()
    for name, artifact_config in ids.items():
        ranks = load_config(None, [f"{name}.world_size=8", f"{name}.grad_accum=8"])
        hosts = load_config(None, [f"{name}.hostfile={hostfile}", f"{name}.grad_accum=8"])
        plain = load_config(None, [f"{name}.grad_accum=8"])
        assert artifact_config(ranks) == artifact_config(hosts) == artifact_config(plain), name
        assert artifact_config(plain) != artifact_config(base), name  # a real knob does count
    dpo_ranks = load_config(None, ["dpo.world_size=2", "dpo.grad_accum=2"])
    assert stages.dpo.train_section(dpo_ranks.dpo, 1).world_size == 2  # reaches run_training


@pytest.mark.integration
def test_a_failed_launch_is_one_line_naming_the_log(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "print('starting'); raise ValueError('bad rank')"]
    with pytest.raises(RuntimeError) as err:
        launch._run_launcher(command, {}, tmp_path / "launcher.log", ranks=2)
    message = str(err.value)
    assert "\n" not in message
    assert "training on 2 ranks failed (deepspeed exit 1): ValueError: bad rank" in message
    assert "Traceback" in (tmp_path / "launcher.log").read_text()


def val_loss(examples: list[dict]) -> launch.Validate:
    """A validation factory the ranks rebuild from its pickle: the val loss on `examples`."""

    def validate(module: torch.nn.Module) -> dict[str, float]:
        value = validation_loss(module, examples, batch_size=4, max_length=32)
        return {"score": -value, "val_loss": value}

    return validate


def test_a_rank_writes_its_result_then_leaves_the_group_with_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank that exits with the gloo group still up can abort in the group's threads
    ("terminate called without an active exception", exit -6) and fail a finished run: each
    rank waits for the others, then destroys the group, after rank 0 has written its result."""
    import torch.distributed as dist

    start = tmp_path / "start"
    tiny_model().save_pretrained(start)
    folder = launch.write_spec(
        tmp_path / "launch", counting(4), model_dir=start, loss="sft", cfg=TrainSection(),
        out_dir=tmp_path / "out", seed=0, params=launch.LossParams(), reference=False,
        validation=None, max_tokens=None, log_every=0, label="rft",
    )  # fmt: skip
    calls: list[str] = []
    result = TrainResult(steps=3, final_loss=0.5, history=[], train_time_s=0.1)

    def fake_train(*args: object, **kwargs: object) -> TrainResult:
        calls.append("train")
        assert kwargs["label"] == "rft"  # the ranks' progress lines name the stage too
        return result

    def record(name: str) -> Callable[[], None]:
        def call() -> None:
            # rank 0's result is on disk before the group goes
            assert (folder / launch.RESULT).is_file()
            calls.append(name)

        return call

    monkeypatch.setattr(launch, "train", fake_train)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "barrier", record("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", record("destroy"))
    launch.main([str(folder)])
    assert calls == ["train", "barrier", "destroy"]
    assert json.loads((folder / launch.RESULT).read_text())["steps"] == 3


@pytest.mark.integration
def test_sft_on_two_cpu_ranks_matches_one_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The ranks import this module to unpickle the validation factory.
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    start = tmp_path / "start"
    tiny_model().save_pretrained(start)
    before = saved_params(start)
    # 16 examples, 2 per micro-batch: 8 micro-batches an epoch, 4 per rank; grad_accum 2 is one
    # per rank per step, so both runs take 4 steps an epoch on the same 4-sequence batches.
    knobs = dict(
        epochs=2, lr=1e-2, warmup_ratio=0.0, micro_batch_size=2, grad_accum=2, max_length=32,
        zero_stage=2, val_every=4, patience=10,
    )  # fmt: skip
    validation = partial(val_loss, counting(6, seed=5))
    runs, logged, took = {}, [], {}
    for ranks in (1, 2):
        begin = time.perf_counter()
        runs[ranks] = run_training(
            LlamaForCausalLM.from_pretrained(start), counting(16), model_dir=start, loss="sft",
            cfg=TrainSection(**knobs, world_size=ranks), out_dir=tmp_path / f"ranks{ranks}",
            validation=validation, log=logged.append if ranks == 2 else None,
        )  # fmt: skip
        took[ranks] = time.perf_counter() - begin
    one, two = runs[1], runs[2]
    assert one.steps == two.steps == 8 and one.tokens == two.tokens
    losses = {r: [h["loss"] for h in runs[r].history if "loss" in h] for r in (1, 2)}
    assert losses[1][-1] < losses[1][0] - 0.5  # it learned: the comparison is not of two no-ops
    # Same micro-batches, same sums: only the order of float32 additions in the gradient
    # all-reduce differs, ~1e-7 relative per step, so 1e-5 leaves a wide margin while a
    # different batch rule (twice the batch, half the steps) fails by orders of magnitude.
    assert losses[2] == pytest.approx(losses[1], rel=1e-5)
    val = {r: [h["val_loss"] for h in runs[r].history if "val_loss" in h] for r in (1, 2)}
    assert len(val[1]) == 3 and val[2] == pytest.approx(val[1], rel=1e-5)  # steps 0, 4, 8
    after = {r: saved_params(tmp_path / f"ranks{r}") for r in (1, 2)}
    moved = (after[1] - before).abs().max().item()
    assert moved > 1e-2
    assert torch.allclose(after[2], after[1], rtol=1e-4, atol=1e-5), (
        (after[2] - after[1]).abs().max().item()
    )
    assert [r["step"] for r in logged] == list(range(1, 9))  # the log replayed after the run
    assert not (tmp_path / "ranks2" / launch.LAUNCH_DIR).exists()
    print(f"1 rank in-process: {took[1]:.1f} s; 2 ranks through the launcher: {took[2]:.1f} s")
