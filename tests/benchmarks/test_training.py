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


def test_cpu_bf16_rows_compare_against_float32(capsys, monkeypatch):
    """--cpu-bf16: a float32 row at 1.00x and a bf16 row whose weights differ from it by bf16
    rounding, small against how far training moved them. host_info is told the CPU has bf16
    instructions, so the rows run on any CPU (torch emulates them where it has not)."""
    import argparse

    from benchmarks.training import compare_precision
    from flywheel.training import loop

    host = loop.host_info()
    monkeypatch.setattr(loop, "host_info", lambda: host | {"cpu_flags": ["avx512_bf16"]})
    cfg = load_config(ROOT / "configs" / "default.yaml", ["expert.n_tasks=24"])
    examples, _, model = demo_examples(cfg)
    base = cfg.sft.model_copy(update={"max_steps": 3, "val_every": 0, "micro_batch_size": 8})
    args = argparse.Namespace(bucket_batches=[1], steps=3, seed=0, repeats=1, threads=1)
    compare_precision(model, examples, base, args)
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    table = {row[0]: row for row in rows if row and row[0] in ("false", "true")}
    assert set(table) == {"false", "true"}
    assert table["false"][3] == "1.00x" and float(table["false"][-1]) == 0.0
    assert 0.0 < float(table["true"][-1]) < 0.15  # |dw|/moved
