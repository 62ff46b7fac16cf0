"""The engine interface: generate one assistant turn for each chat in a batch.

A ``Chat`` carries the conversation so far and, for every assistant turn already in it, the token
ids that were generated for it. Engines that tokenize locally (``hf``) build the prompt from those
ids instead of re-tokenizing the text, so training sees exactly what was sampled (ALGORITHMS.md,
"never re-tokenize text for RL").

A chat may force how the next assistant turn begins (``Chat.opening``: token ids, e.g. a
reflection hint): the engine appends them to the prompt after the generation prompt and generates
the rest, and returns the whole turn: ``token_ids`` are the opening ids then the generated ones,
``text`` is decoded from all of them, and each forced id's log-prob is recorded as 0.0 (it was
not sampled: a loss that weighs behaviour log-probs must not count it); ``forced`` says how many
ids lead the turn so. ``max_new_tokens`` counts the generated ids only.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Chat:
    """``messages``: dicts with ``role`` and ``content``; ``turn_token_ids[i]`` belongs to the
    i-th assistant message (may be shorter than the number of assistant messages: the missing
    ones are tokenized from text, e.g. expert turns). ``session`` names the episode the chat
    belongs to: an engine may keep what it computed for the session's last turn and reuse it
    when the next prompt extends it (the hf engine keeps its KV cache); None keeps nothing.
    ``opening``: token ids the next assistant turn starts with (module docstring)."""

    messages: list[dict]
    turn_token_ids: list[list[int]] = field(default_factory=list)
    session: Hashable | None = None
    opening: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int | None = None


@dataclass
class Generation:
    text: str  # decoded turn, without the end-of-turn token
    token_ids: list[int]  # generated ids, including the end-of-turn token when it was produced
    logprobs: list[float]  # log-prob of each generated id under the policy (temperature 1)
    finish_reason: str  # "stop" (end-of-turn token) or "length"
    forced: int = 0  # how many leading token_ids were the chat's opening, not sampled


def opened(gen: Generation, opening: list[int], tokenizer: Any) -> Generation:
    """``gen`` (what the engine generated after a chat's ``opening``) as the whole turn: the
    opening ids first, log-prob 0.0 each, and the text decoded from all the ids but a final
    end-of-turn one. ``gen`` itself when there is no opening."""
    if not opening:
        return gen
    generated = gen.token_ids[:-1] if gen.finish_reason == "stop" else gen.token_ids
    text = tokenizer.decode([*opening, *generated], skip_special_tokens=False)
    return Generation(
        text=str(text),
        token_ids=[*opening, *gen.token_ids],
        logprobs=[0.0] * len(opening) + list(gen.logprobs),
        finish_reason=gen.finish_reason,
        forced=len(opening),
    )


class Engine(Protocol):
    def generate(self, chats: list[Chat], params: SamplingParams) -> list[Generation]: ...

    def close(self) -> None: ...
