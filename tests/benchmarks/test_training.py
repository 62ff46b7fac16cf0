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


def test_length_split_rows_train_the_same_steps(capsys):
    """--length-split: one row per value, on the same steps; the weights stay within float
    rounding of the first value's and the slices pad less than whole micro-batches."""
    import argparse

    from benchmarks.training import compare_splits

    cfg = load_config(ROOT / "configs" / "default.yaml", ["expert.n_tasks=24"])
    examples, _, model = demo_examples(cfg)
    base = cfg.sft.model_copy(
        update={"max_steps": 3, "val_every": 0, "micro_batch_size": 8, "length_split": 1}
    )
    args = argparse.Namespace(
        bucket_batches=[1], steps=3, seed=0, repeats=1, threads=1, length_split=[1, 2]
    )
    compare_splits(model, examples, base, args)
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    table = {row[0]: row for row in rows if row and row[0] in ("1", "2")}
    assert set(table) == {"1", "2"}
    padding = {k: float(row[3].rstrip("%")) for k, row in table.items()}
    assert padding["2"] < padding["1"]
    assert float(table["1"][-1]) == 0.0 and float(table["2"][-1]) < 1e-5  # max |dw|
