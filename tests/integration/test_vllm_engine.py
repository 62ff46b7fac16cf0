"""The ``vllm`` engine for real: explore (round 1) and evaluate (round 0) of the tiny run's SFT
policy with ``engine.kind=vllm``, each stage starting vLLM's OpenAI server (the CPU build, from
the environment ``make vllm-env`` creates) on the policy and stopping it. The behaviour
log-probs vLLM returned for every explored turn equal a transformers forward pass of the same
policy over the same ids, greedy evaluation plays the same episodes as the hf engine, and no
vLLM process is left afterwards.

Needs ``.venv-vllm`` (``make test`` creates it); ``-m "not vllm"`` leaves it out of a quick run.

    .venv/bin/python -m pytest tests/integration/test_vllm_engine.py
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import polars as pl
import pytest
import torch

from flywheel.chat import encode_chat
from flywheel.checkpoint import load_policy
from flywheel.config import load_config
from flywheel.store import Store
from flywheel.trajectory import align_turn_ids
from stages import evaluate, explore
from tests.conftest import run_flywheel, tiny_overrides
from tests.integration.test_openai_engine import episodes
from tests.reliability.test_signals import all_pids, cmdline

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def forward_logprobs(model, tokenizer, row: dict) -> list[list[float]]:
    """Per assistant turn the policy produced, the log-prob of each of its ids under ``model``."""
    messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    turns = align_turn_ids(messages, row["turn_token_ids"])
    out: list[list[float]] = []
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for n, ids in enumerate(row["turn_token_ids"]):
        k = len(assistant) - len(row["turn_token_ids"]) + n  # the k-th assistant message
        prompt = encode_chat(
            tokenizer, messages[: assistant[k]], turns[:k], add_generation_prompt=True
        )[0]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(ids)])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        out.append([logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(ids)])
    return out


@pytest.mark.integration
@pytest.mark.vllm
def test_explore_and_evaluate_through_vllm(tmp_path):
    assert VLLM_PYTHON.exists(), f"{VLLM_PYTHON} is missing: run make vllm-env"
    # vLLM's CPU attention takes head sizes of 32 and up: the tiny run's 16 would be refused.
    hf = tiny_overrides(tmp_path, "model.tiny.hidden_size=64", "model.tiny.num_heads=2")
    run_flywheel(hf, rounds=0)  # the bootstrap, evaluated with the hf engine
    overrides = [
        *hf, "engine.kind=vllm", f"engine.vllm.python={VLLM_PYTHON}",
        "engine.vllm.args=[--enforce-eager]",
    ]  # fmt: skip
    cfg = load_config(None, overrides)
    store = Store(cfg.run.store_root(), cfg.run.name)
    sft = store.latest("sft", 0)
    assert sft is not None
    tasks = {r.manifest.get("split"): r for r in store.list(0, "tasks")}

    explored = explore.run(cfg, store, sft, tasks["train"], round=1)
    rows = cast(pl.DataFrame, pl.from_arrow(store.read(explored))).to_dicts()
    model, tokenizer = load_policy(store, sft)
    turns = 0
    for row in rows:
        assert len(row["turn_logprobs"]) == len(row["turn_token_ids"]) > 0
        want = forward_logprobs(model, tokenizer, row)
        for got, expected in zip(row["turn_logprobs"], want, strict=True):
            assert got == pytest.approx(expected, abs=1e-4)
            turns += 1
    assert turns >= len(rows)

    hf_eval = next(r for r in store.list(0, "evaluate") if r.inputs[0] == sft.id)
    evaluated = evaluate.run(cfg, store, sft, tasks["test"], round=0)
    assert evaluated.id != hf_eval.id
    assert episodes(store, evaluated.id).equals(episodes(store, hf_eval.id))
    assert [c for c in map(cmdline, all_pids()) if "vllm" in c and str(tmp_path) in c] == []
