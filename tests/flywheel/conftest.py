"""Shared tiny parts: a tokenizer trained on arith-like text and a small random model."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from flywheel.model import build_tiny_model, train_tokenizer

CORPUS = [
    "Solve the task. Call <python>print(1 + 2)</python> to run code, then reply <answer>3</answer>.",
    "What is 37 + 12? Tom has 5 apples and buys 7 more.",
    "<python>print(37 + 12)</python>",
    "<answer>49</answer>",
    "Error: NameError: name x is not defined",
    "Ok. Invalid action",
]


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    return list(CORPUS)


@pytest.fixture(scope="session")
def tokenizer(corpus):
    return train_tokenizer(corpus)


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    return build_tiny_model(
        tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0
    ).eval()
