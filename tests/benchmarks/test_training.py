"""benchmarks/training.py trains the demo's policy on the demo's round-0 examples: the tokenizer
and model it builds follow ``model.tiny`` as the init stage does (``build_tiny_policy``)."""

from __future__ import annotations

from benchmarks.training import ROOT, demo_examples
from flywheel.config import load_config


def test_demo_policy_follows_the_tiny_section():
    cfg = load_config(ROOT / "configs" / "default.yaml", ["expert.n_tasks=20"])
    examples, tokenizer, model = demo_examples(cfg)
    assert len(examples) == 20
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.hidden_size == cfg.model.tiny.hidden_size
    # configs/default.yaml cuts numbers into single digits (model.tiny.number_digits: 1)
    assert cfg.model.tiny.number_digits == 1
    assert tokenizer.tokenize("345") == ["3", "4", "5"]
    cfg3 = load_config(
        ROOT / "configs" / "default.yaml", ["expert.n_tasks=20", "model.tiny.number_digits=3"]
    )
    _, tokenizer3, _ = demo_examples(cfg3)
    assert tokenizer3.tokenize("345") == ["345"]
