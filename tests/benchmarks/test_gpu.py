"""benchmarks/gpu.py: its CPU smoke size writes a report with every number measured, and the same
size runs on a GPU in bf16 when there is one (``pytest tests/benchmarks -m gpu`` there)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu

ROOT = Path(__file__).resolve().parents[2]

POSITIVE = {
    "ceiling": ("n", "median_ms", "tflops"),
    "rollout": (
        "episodes", "seconds", "episodes_per_s", "generated_tokens", "generated_tokens_per_s",
        "prompt_tokens_run", "mean_turns", "forward_tflops",
    ),
    "dpo": (
        "pairs", "mean_sequence_tokens", "reference_seconds", "reference_tokens_per_s",
        "reference_tflops", "reference_mfu", "steps", "steady_steps", "steady_seconds",
        "train_tokens", "train_tokens_per_s", "train_tflops", "mfu", "call_seconds",
    ),
    "model": ("hidden", "layers", "vocab", "parameters"),
}  # fmt: skip


def check_report(report: dict) -> None:
    for part, keys in POSITIVE.items():
        for key in keys:
            value = report[part][key]
            assert isinstance(value, int | float) and math.isfinite(value) and value > 0, (
                f"{part}.{key} = {value!r}"
            )
    assert report["rollout"]["episodes"] == 8
    assert report["dpo"]["pairs"] == 4  # one pair per task, two samples each
    assert report["dpo"]["steps"] == 3 and report["dpo"]["steady_steps"] == 2
    assert report["dpo"]["same_batches"] is True  # the loop ran the planned batches
    assert 0 <= report["dpo"]["padding_share"] < 1
    assert 0 <= report["rollout"]["env_share"] < 1
    assert math.isfinite(report["dpo"]["final_loss"])
    assert report["vllm"]["ran"] is False and report["vllm"]["note"]
    assert report["environment"]["torch"] == torch.__version__


def test_small_run_writes_every_number(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    report = gpu.main(["--small", "--device", "cpu", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    check_report(report)
    assert report["dpo"]["bf16"] is False and report["ceiling"]["dtype"] == "float32"
    printed = capsys.readouterr().out
    for part in ("ceiling", "rollout", "dpo ref", "dpo train", "vllm engine:"):
        assert part in printed


def test_bad_arguments_are_refused(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "x.json")
    with pytest.raises(SystemExit):
        gpu.main(["--small", "--train-steps", "1", "--out", out])
    assert "--train-steps must be at least 2" in capsys.readouterr().err
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    with pytest.raises(SystemExit):
        gpu.main(["--small", "--device", "cpu", "--out", out])
    assert "DS_ACCELERATOR=cuda but the device is cpu" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_small_run_on_gpu_in_bf16(tmp_path):
    # Its own process: DeepSpeed keeps the first accelerator a process picks (cpu in this session).
    out = tmp_path / "gpu.json"
    command = [
        sys.executable,
        "-m",
        "benchmarks.gpu",
        "--small",
        "--device",
        "cuda",
        "--out",
        str(out),
    ]
    env = os.environ | {"DS_ACCELERATOR": "cuda"}
    subprocess.run(command, cwd=ROOT, env=env, check=True, timeout=300)
    report = json.loads(out.read_text())
    check_report(report)
    assert report["dpo"]["bf16"] is True and report["ceiling"]["dtype"] == "bfloat16"
    assert report["ceiling"]["relative_error"] < 1e-2
