"""Token ids and loss mask of a conversation, for any Hugging Face chat template.

The sequence is built message by message from the template's text deltas: message ``i``
contributes ``render(messages[:i+1])`` minus ``render(messages[:i])``. An assistant message is
split into its header (what ``add_generation_prompt`` adds), its content plus end-of-turn token
(the part the model generates, and the part that is trained), and whatever the template writes
after the end-of-turn token. So the ids in front of every assistant turn are exactly the prompt
the engine saw when it generated that turn, and a turn whose generated ids were stored is spliced
in as those ids, never re-tokenized (ALGORITHMS.md, "never re-tokenize text for RL"). Which
assistant messages a trajectory's stored ids belong to is ``flywheel.trajectory``'s rule.

    ids, mask = encode_chat(tokenizer, messages, turn_token_ids)         # training
    ids, _ = encode_chat(tokenizer, messages, turn_ids, add_generation_prompt=True)  # a prompt
    ids = PromptEncoder(tokenizer).prompt(messages, turn_ids, session=episode)  # the same, resumed
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # keeps this module importable without loading transformers
    from transformers import PreTrainedTokenizerBase


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation: bool) -> str:
    if not messages:  # transformers refuses to render an empty conversation
        return ""
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=generation)
    assert isinstance(text, str)
    return text


def _delta(longer: str, shorter: str, what: str) -> str:
    if not longer.startswith(shorter):
        raise ValueError(
            f"the chat template is not prefix-stable: rendering {what} does not start with the "
            f"rendering before it ({shorter[-80:]!r} vs {longer[len(shorter) - 80 : len(shorter) + 20]!r}); "
            "encode_chat needs templates that only append text as messages are added"
        )
    return longer[len(shorter) :]


def _ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    # No BOS/EOS from the tokenizer: the template writes every special token itself.
    return tokenizer.encode(text, add_special_tokens=False) if text else []


def _split_end_of_turn(tokenizer: PreTrainedTokenizerBase, tail: str) -> tuple[int, str]:
    """The end-of-turn token at the start of ``tail`` (what follows an assistant message's
    content) and the text after it. It is the eos token for most templates, or another special
    token such as Llama 3's ``<|eot_id|>``."""
    eos = tokenizer.eos_token
    if eos and tail.startswith(eos):
        return tokenizer.eos_token_id, tail[len(eos) :]
    added = tokenizer.get_added_vocab()
    for token in sorted(added, key=len, reverse=True):  # longest first: "<|end|>" before "<|e"
        if tail.startswith(token):
            return added[token], tail[len(token) :]
    raise ValueError(
        f"the chat template does not close assistant turns with a special token: {tail[:40]!r} "
        f"follows the content (eos is {eos!r})"
    )


@dataclass
class _Fold:
    """What encoding a conversation's first ``n_messages`` messages left: the ids and mask so
    far, the template's rendering of those messages, and how many assistant turns they held."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    previous: str = ""
    n_messages: int = 0
    n_assistant: int = 0
    generation_prompt: str | None = None  # the rendering of the same messages as a prompt

    def copy(self) -> _Fold:
        return _Fold(
            list(self.ids),
            list(self.mask),
            self.previous,
            self.n_messages,
            self.n_assistant,
            self.generation_prompt,
        )


def _fold(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    turn_token_ids: Sequence[Sequence[int] | None],
    state: _Fold,
) -> _Fold:
    """Extend ``state`` (the encoding of ``messages[:state.n_messages]``, changed in place) with
    the rest of ``messages``. Message ``i``'s ids depend only on ``messages[: i + 1]`` and the
    stored ids of the assistant turns among them, which is what lets ``PromptEncoder`` resume."""
    ids, mask = state.ids, state.mask

    def extend(new: list[int], trained: bool) -> None:
        ids.extend(new)
        mask.extend([int(trained)] * len(new))

    for i in range(state.n_messages, len(messages)):
        message = messages[i]
        rendered = _render(tokenizer, messages[: i + 1], False)
        if message["role"] != "assistant":
            extend(_ids(tokenizer, _delta(rendered, state.previous, f"message {i}")), False)
            state.previous, state.n_messages, state.generation_prompt = rendered, i + 1, None
            continue

        if i == 0:
            raise ValueError(
                "a conversation cannot start with an assistant message (no prompt to render)"
            )
        prompt = state.generation_prompt or _render(tokenizer, messages[:i], True)
        extend(
            _ids(
                tokenizer,
                _delta(prompt, state.previous, f"the generation prompt before message {i}"),
            ),
            False,
        )
        body = _delta(rendered, prompt, f"assistant message {i}")
        content = message["content"]
        if not body.startswith(content):
            stripped = content.strip()  # some templates trim the content
            if not body.startswith(stripped):
                raise ValueError(
                    f"assistant message {i}'s content is not rendered verbatim by the chat template"
                )
            content = stripped
        end_id, after = _split_end_of_turn(tokenizer, body[len(content) :])

        n = state.n_assistant
        stored = turn_token_ids[n] if n < len(turn_token_ids) else None
        trained = bool(message.get("loss", False))
        if not stored:
            extend(_ids(tokenizer, content) + [end_id], trained)
        else:
            extend(list(stored), trained)
            if stored[-1] != end_id:
                # Cut at max_new_tokens: the template still closes the turn, but the model did
                # not generate that token, so it is not trained (mask stays aligned with logprobs).
                extend([end_id], False)
        extend(_ids(tokenizer, after), False)
        state.previous, state.n_messages, state.n_assistant = rendered, i + 1, n + 1
        state.generation_prompt = None
    return state


def _generation_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], state: _Fold
) -> list[int]:
    """The ids the template's generation prompt adds after ``state``'s messages (all of them).
    The rendering is kept in ``state``: the assistant message that follows starts from it."""
    if not messages:
        return []
    prompt = state.generation_prompt = _render(tokenizer, messages, True)
    return _ids(tokenizer, _delta(prompt, state.previous, "the generation prompt"))


def encode_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict],
    turn_token_ids: Sequence[Sequence[int] | None] = (),
    *,
    add_generation_prompt: bool = False,
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of ``messages`` (dicts with ``role``, ``content`` and optional
    ``loss``). ``turn_token_ids[j]`` holds the generated ids (content and end-of-turn token) of the
    j-th assistant message; a missing, empty or ``None`` entry means tokenize the content. The
    mask is 1 on the content and end-of-turn token of assistant messages with ``loss`` true; a
    stored turn that was cut before its end-of-turn token gets one appended, untrained."""
    messages = list(messages)
    state = _fold(tokenizer, messages, turn_token_ids, _Fold())
    if add_generation_prompt:
        tail = _generation_prompt(tokenizer, messages, state)
        state.ids.extend(tail)
        state.mask.extend([0] * len(tail))
    return state.ids, state.mask


def _message_key(message: dict, stored: Sequence[int] | None) -> tuple:
    return (
        message["role"],
        message["content"],
        bool(message.get("loss", False)),
        tuple(stored or ()),
    )


class PromptEncoder:
    """``encode_chat(..., add_generation_prompt=True)[0]`` for the turns of many episodes at
    once, each resumed from what its previous turn encoded.

    A multi-turn episode's prompt at turn t is its prompt at turn t-1 plus two messages, but
    ``encode_chat`` renders every prefix again: O(t^2) template renders per episode. Given the
    episode's ``session``, this keeps the encoding of the messages it saw last and, when the
    next conversation starts with exactly those messages (same role, content, loss flag and
    stored ids), encodes only the new ones. Anything else (no session, an edited or shorter
    history) is encoded from the start. The ids are the same either way (tested).

    The memo keeps the ``max_sessions`` most recently used sessions; ``keep_only`` forgets every
    session not named (the hf engine keeps those of its current call: one per live episode).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_sessions: int = 1024) -> None:
        self.tokenizer = tokenizer
        self.max_sessions = max_sessions
        self._sessions: dict[Hashable, tuple[list[tuple], _Fold]] = {}  # oldest use first

    def prompt(
        self,
        messages: Sequence[dict],
        turn_token_ids: Sequence[Sequence[int] | None] = (),
        session: Hashable | None = None,
    ) -> list[int]:
        messages = list(messages)
        if session is None:
            return encode_chat(
                self.tokenizer, messages, turn_token_ids, add_generation_prompt=True
            )[0]
        keys, n_assistant = [], 0
        for m in messages:
            stored = None
            if m["role"] == "assistant":
                stored = turn_token_ids[n_assistant] if n_assistant < len(turn_token_ids) else None
                n_assistant += 1
            keys.append(_message_key(m, stored))
        seen = self._sessions.pop(session, None)
        resumable = seen is not None and seen[0] == keys[: len(seen[0])]
        state = seen[1].copy() if seen is not None and resumable else _Fold()
        state = _fold(self.tokenizer, messages, turn_token_ids, state)
        self._sessions[session] = (keys, state)  # the next call copies it before extending
        if len(self._sessions) > self.max_sessions:
            del self._sessions[next(iter(self._sessions))]
        return state.ids + _generation_prompt(self.tokenizer, messages, state)

    def keep_only(self, sessions: set[Hashable]) -> None:
        self._sessions = {s: v for s, v in self._sessions.items() if s in sessions}
