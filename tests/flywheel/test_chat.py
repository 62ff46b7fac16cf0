from __future__ import annotations

import pytest

from flywheel.chat import PromptEncoder, encode_chat
from flywheel.model import train_tokenizer

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MESSAGES = [
    {"role": "system", "content": "Call to run code."},
    {"role": "user", "content": "Solve the task."},
    {"role": "assistant", "content": "Ok.", "loss": False},
    {"role": "user", "content": "What is 37 + 12?"},
    {"role": "assistant", "content": "<python>print(37 + 12)</python>", "loss": True},
    {"role": "user", "content": "49"},
    {"role": "assistant", "content": "<answer>49</answer>", "loss": True},
]


@pytest.fixture(scope="module")
def chatml_tokenizer(corpus):
    tok = train_tokenizer([*corpus, "system user assistant"])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHATML
    return tok


@pytest.fixture(params=["ours", "chatml"])
def tok(request, tokenizer, chatml_tokenizer):
    return tokenizer if request.param == "ours" else chatml_tokenizer


def assistant_spans(ids, mask):
    """(start, end) of each run of trained tokens."""
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_sequence_is_the_rendered_template_and_mask_covers_trained_turns(tok):
    ids, mask = encode_chat(tok, MESSAGES)
    assert len(ids) == len(mask)
    assert tok.decode(ids) == tok.apply_chat_template(MESSAGES, tokenize=False)
    trained = [tok.decode(ids[a:b]) for a, b in assistant_spans(ids, mask)]
    eos = tok.eos_token
    assert trained == [f"<python>print(37 + 12)</python>{eos}", f"<answer>49</answer>{eos}"]


def test_prefix_before_each_assistant_turn_is_the_generation_prompt(tok):
    ids, mask = encode_chat(tok, MESSAGES)
    for k, message in enumerate(MESSAGES):
        if message["role"] != "assistant":
            continue
        prompt, prompt_mask = encode_chat(tok, MESSAGES[:k], add_generation_prompt=True)
        assert ids[: len(prompt)] == prompt and prompt_mask == mask[: len(prompt)]
        assert tok.decode(prompt) == tok.apply_chat_template(
            MESSAGES[:k], tokenize=False, add_generation_prompt=True
        )
        content = tok.encode(message["content"], add_special_tokens=False)
        assert ids[len(prompt) : len(prompt) + len(content)] == content


def test_stored_turn_ids_are_used_verbatim(tokenizer):
    # "49" tokenizes as one piece; the policy may have produced "4", "9": keep what it produced.
    stored = tokenizer.convert_tokens_to_ids(["<answer>", "4", "9", "</answer>", "<|end|>"])
    messages = MESSAGES[3:5] + [MESSAGES[5], MESSAGES[6]]
    ids, mask = encode_chat(tokenizer, messages, [[], stored])
    spans = assistant_spans(ids, mask)
    assert ids[slice(*spans[-1])] == stored
    assert (
        ids[: spans[-1][0]]
        == encode_chat(tokenizer, messages[:3], [[]], add_generation_prompt=True)[0]
    )
    # A prompt with the stored turn continues after it exactly like the template does.
    prompt, _ = encode_chat(
        tokenizer,
        [*messages, {"role": "user", "content": "ok"}],
        [[], stored],
        add_generation_prompt=True,
    )
    assert prompt[: spans[-1][1]] == ids[: spans[-1][1]]


def test_turn_cut_at_max_tokens_gets_an_untrained_end_of_turn(tokenizer):
    cut = tokenizer.encode("<answer>4", add_special_tokens=False)
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<answer>4", "loss": True},
    ]
    ids, mask = encode_chat(tokenizer, messages, [cut])
    start = mask.index(1)
    assert ids[start : start + len(cut) + 1] == [*cut, tokenizer.eos_token_id]
    assert sum(mask) == len(cut) and mask[start + len(cut)] == 0


def test_loss_defaults_to_false_and_empty_chat(tokenizer):
    ids, mask = encode_chat(
        tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Ok."}]
    )
    assert ids and not any(mask)
    with pytest.raises(ValueError, match="start with an assistant"):
        encode_chat(tokenizer, [{"role": "assistant", "content": "Ok."}])


def test_template_that_rewrites_earlier_turns_is_rejected(corpus):
    tok = train_tokenizer(corpus)
    # Marks only the last message: rendering a longer chat changes the earlier text.
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}<|end|>{% endfor %}"
    )
    with pytest.raises(ValueError, match="prefix"):
        encode_chat(tok, MESSAGES[1:3])


def test_end_of_turn_token_other_than_eos(corpus):
    # Llama 3 style: turns end with <|eot|> while eos stays another token.
    tok = train_tokenizer(corpus)
    tok.add_special_tokens({"additional_special_tokens": ["<|eot|>"]})
    tok.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<|eot|>' }}{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    ids, mask = encode_chat(tok, MESSAGES[3:5])
    assert (
        tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
        == "<python>print(37 + 12)</python><|eot|>"
    )


def _prompt(tok, messages, turns=()):
    return encode_chat(tok, messages, turns, add_generation_prompt=True)[0]


def test_prompt_encoder_resumes_each_session_and_matches_encode_chat(tok):
    """Two interleaved episodes, turn by turn, one with stored ids that tokenize differently
    from the text: every prompt is the one encode_chat gives for the whole conversation, and
    from the second turn on the encoder renders only the two new messages and the generation
    prompt (3 renders: the assistant message starts from the last generation prompt), where
    encode_chat renders every prefix again."""
    encoder = PromptEncoder(tok)
    piece = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    # One character at a time: not how the tokenizer would split the text.
    stored = [i for ch in "<python>print(37 + 12)</python>" for i in piece(ch)]
    stored.append(tok.eos_token_id)
    episodes = {"a": [], "b": [[], stored]}
    renders = []
    original = tok.apply_chat_template

    def counting(conversation, **kw):
        renders.append(len(conversation))
        return original(conversation, **kw)

    tok.apply_chat_template = counting
    try:
        for k in (2, 4, 6):  # the prompt before each assistant turn
            for session, turns in episodes.items():
                renders.clear()
                got = encoder.prompt(MESSAGES[:k], turns, session=session)
                assert len(renders) == 3, (session, k)
                assert got == _prompt(tok, MESSAGES[:k], turns), (session, k)
    finally:
        tok.apply_chat_template = original
    assert _prompt(tok, MESSAGES[:6], episodes["b"]) != _prompt(tok, MESSAGES[:6])


def test_prompt_encoder_starts_over_when_the_history_changed(tok):
    encoder = PromptEncoder(tok)
    encoder.prompt(MESSAGES[:4], session=1)
    edited = [*MESSAGES[:3], {"role": "user", "content": "What is 40 + 2?"}, *MESSAGES[4:6]]
    assert encoder.prompt(edited, session=1) == _prompt(tok, edited)
    # Shorter than what the session saw (a search restoring an earlier node), and new stored ids
    # for a turn that was tokenized from text before.
    assert encoder.prompt(MESSAGES[:2], session=1) == _prompt(tok, MESSAGES[:2])
    encoder.prompt(MESSAGES[:4], session=2)
    turns = [tok.encode("Ok", add_special_tokens=False) + [tok.eos_token_id]]
    assert encoder.prompt(MESSAGES[:4], turns, session=2) == _prompt(tok, MESSAGES[:4], turns)
    # No session: nothing kept.
    assert encoder.prompt(MESSAGES[:6], session=None) == _prompt(tok, MESSAGES[:6])
    encoder.keep_only({1})
    assert set(encoder._sessions) == {1}


def test_prompt_encoder_keeps_the_most_recently_used_sessions(tokenizer):
    encoder = PromptEncoder(tokenizer, max_sessions=2)
    for session in (1, 2, 1, 3):  # 1 was used after 2, so 2 is the one forgotten
        encoder.prompt(MESSAGES[:2], session=session)
    assert list(encoder._sessions) == [1, 3]
