"""A trajectory: one episode's conversation and the token ids the policy generated in it.

``Trajectory`` is a row of the ``trajectories`` contract (data_contracts/trajectories.py) as a
type: ``messages`` (dicts with ``role``, ``content`` and ``loss``), ``turn_token_ids`` and
``turn_logprobs``, and the row's other columns in ``fields``, kept as they are. It is where the
one rule about stored ids lives:

    ``turn_token_ids`` (and ``turn_logprobs``) hold one list per *generated* assistant turn, and
    the generated turns are the LAST assistant messages. The earlier ones (the ``Ok.``
    acknowledgement, expert turns, a spliced prefix before a revision turn) have no stored ids
    and are tokenized from their text.

So ids follow their turns when a trajectory is cut (``split``, ``stored_span``) or pieces are
joined (``+``: a piece with an assistant turn that has no ids ends the run of generated turns
before it), and training encodes sampled turns from their stored ids, never from re-tokenized
text (ALGORITHMS.md):

    traj = Trajectory.from_row(row)                          # a trajectories (or groups) row
    ids, mask = traj.encode(tokenizer)                       # sft, dpo
    ids, mask, old_logprobs = traj.encode_sampled(tokenizer) # grpo
    chat = traj.chat(session=episode)                        # an engine prompt
    assert traj.to_row() == row
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from flywheel.chat import encode_chat
from flywheel.engines.base import Chat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

STORED = ("messages", "turn_token_ids", "turn_logprobs")
T = TypeVar("T")


def stored_span(
    n_assistant: Any, n_stored: Any, first: Any, stop: Any, maximum: Callable[..., Any] = max
) -> tuple[Any, Any]:
    """``(start, end)``: the stored lists that belong to assistant messages ``first`` to
    ``stop - 1`` (counted among a trajectory's ``n_assistant`` assistant messages) are
    ``turn_token_ids[start:end]``. List j belongs to assistant message
    ``n_assistant - n_stored + j``. Only ``+``, ``-`` and ``maximum``, so that flywheel/pareto.py
    evaluates the same rule on polars columns (``maximum=pl.max_horizontal``)."""
    offset = n_assistant - n_stored
    start = maximum(first - offset, 0)
    return start, maximum(stop - offset, start)


def _assistants(messages: Sequence[Mapping]) -> int:
    return sum(m["role"] == "assistant" for m in messages)


def align_turn_ids(
    messages: Sequence[Mapping], turn_token_ids: Sequence[Sequence[T]]
) -> list[list[T]]:
    """One list per assistant message of ``messages``, as ``encode_chat`` and engines want
    them: the stored lists (ids, or their log-probs) on the last assistant messages, ``[]``
    ("tokenize the text") on the ones before."""
    n_assistant = _assistants(messages)
    if len(turn_token_ids) > n_assistant:
        raise ValueError(f"{len(turn_token_ids)} stored turns for {n_assistant} assistant messages")
    return [[] for _ in range(n_assistant - len(turn_token_ids))] + [
        list(t) for t in turn_token_ids
    ]


@dataclass(frozen=True)
class Trajectory:
    """One episode (or a piece of one: ``split``, ``+``); see the module docstring."""

    messages: list[dict]
    turn_token_ids: list[list[int]] = field(default_factory=list)
    turn_logprobs: list[list[float]] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)  # the row's other columns

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Trajectory:
        """From a trajectories or groups row (a missing or null id column reads as empty)."""
        return cls(
            messages=list(row["messages"]),
            turn_token_ids=list(row.get("turn_token_ids") or []),
            turn_logprobs=list(row.get("turn_logprobs") or []),
            fields={k: v for k, v in row.items() if k not in STORED},
        )

    def to_row(self) -> dict[str, Any]:
        return {
            **self.fields,
            "messages": self.messages,
            "turn_token_ids": self.turn_token_ids,
            "turn_logprobs": self.turn_logprobs,
        }

    @classmethod
    def from_turns(
        cls,
        messages: list[dict],
        token_ids: Sequence[Sequence[int] | None],
        logprobs: Sequence[Sequence[float] | None],
    ) -> Trajectory:
        """From the ids and log-probs of every assistant message (empty or None where a turn
        was not generated): only the last run of generated turns keeps its ids."""
        n_assistant = _assistants(messages)
        if not len(token_ids) == len(logprobs) == n_assistant:
            raise ValueError(
                f"{len(token_ids)} id lists and {len(logprobs)} log-prob lists for "
                f"{n_assistant} assistant messages"
            )
        run = 0
        while run < n_assistant and token_ids[n_assistant - 1 - run]:
            run += 1
        return cls(
            messages,
            [list(t or []) for t in token_ids[n_assistant - run :]],
            [list(lp or []) for lp in logprobs[n_assistant - run :]],
        )

    def __add__(self, other: Trajectory) -> Trajectory:
        """The two conversations one after the other (``fields`` from the first). The ids of
        the first survive only if every assistant turn of ``other`` has stored ids."""
        keep = len(other.turn_token_ids) == other.n_assistant
        return Trajectory(
            self.messages + other.messages,
            (self.turn_token_ids if keep else []) + other.turn_token_ids,
            (self.turn_logprobs if keep else []) + other.turn_logprobs,
            self.fields,
        )

    @property
    def n_assistant(self) -> int:
        return _assistants(self.messages)

    def split(self, at: int) -> tuple[Trajectory, Trajectory]:
        """The first ``at`` messages and the rest, each with the stored ids and log-probs of
        its own generated turns (both keep ``fields``): ``head + tail`` is the trajectory."""
        before = _assistants(self.messages[:at])
        _, cut = stored_span(self.n_assistant, len(self.turn_token_ids), 0, before)
        ids, lps = self.turn_token_ids, self.turn_logprobs
        head = replace(
            self, messages=self.messages[:at], turn_token_ids=ids[:cut], turn_logprobs=lps[:cut]
        )
        tail = replace(
            self, messages=self.messages[at:], turn_token_ids=ids[cut:], turn_logprobs=lps[cut:]
        )
        return head, tail

    def turn_ids(self) -> list[list[int]]:
        """The stored ids of every assistant message, ``[]`` where it is tokenized from text."""
        try:
            return align_turn_ids(self.messages, self.turn_token_ids)
        except ValueError as err:
            raise ValueError(f"{self.name()}: {err}") from None

    def name(self) -> str:
        """How errors name the trajectory: env/task and sample, where the row has them."""
        f = self.fields
        where = "/".join(str(f[k]) for k in ("env", "task_id") if k in f)
        sample = f" sample {f['sample_idx']}" if "sample_idx" in f else ""
        return f"trajectory {where}{sample}".rstrip()

    def chat(self, **fields: Any) -> Chat:
        """The conversation as an engine prompt: roles, contents and every turn's stored ids;
        ``fields`` are the Chat's others (``session``, ...)."""
        plain = [{"role": m["role"], "content": m["content"]} for m in self.messages]
        return Chat(messages=plain, turn_token_ids=self.turn_ids(), **fields)

    def encode(self, tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
        """``(input_ids, loss_mask)`` for training: generated turns on their stored ids, the
        others from text; the mask covers assistant messages with ``loss`` true."""
        return encode_chat(tokenizer, self.messages, self.turn_ids())

    def encode_sampled(
        self, tokenizer: PreTrainedTokenizerBase
    ) -> tuple[list[int], list[int], list[float]]:
        """``(input_ids, loss_mask, old_logprobs)`` for policy-gradient training: exactly the
        generated turns are trained (whatever the ``loss`` flags say), and each stored
        log-prob sits on the position of its id (0 elsewhere). The trained positions must
        hold the stored ids in order: a conversation that does not encode to them is an
        error, never silently re-aligned."""
        stored, lps = self.turn_token_ids, self.turn_logprobs
        if len(stored) != len(lps) or any(
            len(i) != len(lp) for i, lp in zip(stored, lps, strict=False)
        ):
            raise ValueError(f"{self.name()}: turn_token_ids and turn_logprobs differ in shape")
        turn_ids = self.turn_ids()
        messages, turn = [], 0
        for m in self.messages:
            sampled = m["role"] == "assistant" and bool(turn_ids[turn])
            turn += m["role"] == "assistant"
            messages.append({**m, "loss": sampled})
        ids, mask = encode_chat(tokenizer, messages, turn_ids)
        trained = [i for i, m in enumerate(mask) if m]
        flat_ids = [t for generated in stored for t in generated]
        if [ids[i] for i in trained] != flat_ids:
            raise ValueError(
                f"{self.name()}: the loss mask covers {len(trained)} tokens but {len(flat_ids)} "
                "ids were stored (or they differ): the conversation does not encode to its "
                "sampled ids"
            )
        old = [0.0] * len(ids)
        for i, lp in zip(trained, [lp for generated in lps for lp in generated], strict=True):
            old[i] = float(lp)
        return ids, mask, old
