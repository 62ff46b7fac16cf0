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
"""

from __future__ import annotations

from collections.abc import Sequence
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
    ids: list[int] = []
    mask: list[int] = []

    def extend(new: list[int], trained: bool) -> None:
        ids.extend(new)
        mask.extend([int(trained)] * len(new))

    previous = ""
    n_assistant = 0
    for i, message in enumerate(messages):
        rendered = _render(tokenizer, messages[: i + 1], False)
        if message["role"] != "assistant":
            extend(_ids(tokenizer, _delta(rendered, previous, f"message {i}")), False)
            previous = rendered
            continue

        if i == 0:
            raise ValueError(
                "a conversation cannot start with an assistant message (no prompt to render)"
            )
        prompt = _render(tokenizer, messages[:i], True)
        extend(
            _ids(tokenizer, _delta(prompt, previous, f"the generation prompt before message {i}")),
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

        stored = turn_token_ids[n_assistant] if n_assistant < len(turn_token_ids) else None
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
        previous = rendered
        n_assistant += 1

    if add_generation_prompt and messages:
        prompt = _render(tokenizer, messages, True)
        extend(_ids(tokenizer, _delta(prompt, previous, "the generation prompt")), False)
    return ids, mask
