"""The engine interface: generate one assistant turn for each chat in a batch.

A ``Chat`` carries the conversation so far and, for every assistant turn already in it, the token
ids that were generated for it. Engines that tokenize locally (``hf``) build the prompt from those
ids instead of re-tokenizing the text, so training sees exactly what was sampled (ALGORITHMS.md,
"never re-tokenize text for RL").
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class Chat:
    """``messages``: dicts with ``role`` and ``content``; ``turn_token_ids[i]`` belongs to the
    i-th assistant message (may be shorter than the number of assistant messages: the missing
    ones are tokenized from text, e.g. expert turns). ``session`` names the episode the chat
    belongs to: an engine may keep what it computed for the session's last turn and reuse it
    when the next prompt extends it (the hf engine keeps its KV cache); None keeps nothing."""

    messages: list[dict]
    turn_token_ids: list[list[int]] = field(default_factory=list)
    session: Hashable | None = None


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


class Engine(Protocol):
    def generate(self, chats: list[Chat], params: SamplingParams) -> list[Generation]: ...

    def close(self) -> None: ...
