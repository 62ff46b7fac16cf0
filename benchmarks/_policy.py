"""The random-init policy the benchmarks run: a word-level tokenizer trained on a suite's text and
a tiny Llama from the project's model code (``flywheel.model``).

    model, tokenizer = tiny_policy(suite, hidden=128, layers=4)             # multiturn, rollouts
    model, tokenizer = tiny_policy(suite, experts=tasks, prompts=suite.tasks("train", 200, seed=1),
                                   hidden=128, layers=4)                    # mcts_tokens
    model, tokenizer = tiny_policy(suite, hidden=1536, layers=16, heads=12,
                                   intermediate=4608, max_positions=4096)   # gpu

The same arguments give the same vocabulary, ids and weights (``train_tokenizer`` and
``build_tiny_model`` are deterministic; the weights come from ``seed`` without touching the
global RNG). The model is returned as built (in training mode): callers that only generate call
``.eval()``.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from flywheel.envs.base import EnvSuite, Task
from flywheel.model import build_tiny_model, train_tokenizer

PROMPT_TASKS = 200  # train tasks whose prompts the tokenizer sees, by default
EXPERT_TASKS = 50  # of those, the ones whose expert turns it sees, by default


def policy_texts(
    suite: EnvSuite, prompts: Sequence[Task] | None = None, experts: Sequence[Task] | None = None
) -> list[str]:
    """The suite's instruction, the prompts of ``prompts`` and the expert turns of ``experts``.

    Defaults: ``prompts`` the first 200 train tasks of seed 123, ``experts`` the first 50 of
    ``prompts``."""
    if prompts is None:
        prompts = suite.tasks("train", PROMPT_TASKS, seed=123)
    if experts is None:
        experts = prompts[:EXPERT_TASKS]
    texts = [suite.instruction, *(t.prompt for t in prompts)]
    return texts + [turn for t in experts for turn in suite.expert(t)]


def tiny_policy(
    suite: EnvSuite,
    *,
    hidden: int,
    layers: int,
    heads: int = 4,
    intermediate: int | None = None,
    max_positions: int = 2048,
    prompts: Sequence[Task] | None = None,
    experts: Sequence[Task] | None = None,
    seed: int = 0,
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A tokenizer trained on ``policy_texts(suite, prompts, experts)`` and a random-init Llama
    sized to it: ``hidden`` wide, ``layers`` deep, ``heads`` attention heads, an MLP of
    ``intermediate`` (default 3 x ``hidden``), ``max_positions`` positions, weights from
    ``seed``."""
    if hidden <= 0 or layers <= 0 or heads <= 0 or hidden % heads:
        raise ValueError(
            f"tiny_policy: hidden {hidden} must be a positive multiple of heads {heads}, "
            f"layers {layers} positive"
        )
    tokenizer = train_tokenizer(policy_texts(suite, prompts, experts))
    model = build_tiny_model(
        tokenizer,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        intermediate_size=3 * hidden if intermediate is None else intermediate,
        max_position_embeddings=max_positions,
        seed=seed,
    )
    return model, tokenizer
