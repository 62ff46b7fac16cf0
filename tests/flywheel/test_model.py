from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flywheel.model import (
    SPECIAL_TOKENS,
    build_tiny_model,
    load_policy,
    save_policy,
    train_tokenizer,
)


def pieces(tokenizer, text):
    return tokenizer.convert_ids_to_tokens(tokenizer.encode(text, add_special_tokens=False))


def test_pieces_are_tags_digit_groups_words_and_single_characters(tokenizer):
    assert pieces(tokenizer, "<python>print(12345 + 7)</python>\n") == [
        "<python>", "print", "(", "123", "45", " ", "+", " ", "7", ")", "</python>", "\n",
    ]  # fmt: skip
    assert pieces(tokenizer, "<answer>49</answer>") == ["<answer>", "49", "</answer>"]
    assert "<|unk|>" not in pieces(tokenizer, "Error: x")


@pytest.mark.parametrize(
    "text",
    [
        "<python>print(37 + 12)</python>",
        "What is 1000000 - 007?\n  Tom has 5 apples.",
        "~!@#$%^&*()_+{}|:\"<>?`-=[]\\;',./ \t\n",
        "<|user|>Error: name x<|end|>\n<|assistant|>",
    ],
)
def test_decoding_is_lossless(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_vocabulary_and_special_tokens(tokenizer):
    vocab = tokenizer.get_vocab()
    assert [vocab[t] for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert all(str(i).zfill(w) in vocab for w in (1, 2, 3) for i in range(10**w))
    assert all(chr(c) in vocab for c in range(32, 127))
    assert tokenizer.eos_token == "<|end|>" and tokenizer.pad_token == "<|pad|>"
    assert pieces(tokenizer, "<|assistant|>") == ["<|assistant|>"]
    # Unseen words are unknown; min_frequency drops rare ones.
    assert "zebra" not in vocab
    rare = train_tokenizer(["apple apple pear"], min_frequency=2).get_vocab()
    assert "apple" in rare and "pear" not in rare
    # A word takes the space before it, and both forms are known whichever one was seen.
    assert " apple" in rare and " pear" not in rare
    assert pieces(tokenizer, "has") == ["has"] and pieces(tokenizer, " has") == [" has"]


def test_numbers_cut_into_single_digits_with_number_digits_1(tmp_path):
    """number_digits=1: every number is its digits (no 2- or 3-digit pieces in the vocabulary),
    decoding stays lossless, and a saved tokenizer loads with the same cut."""
    texts = ["There are 122 pencils.", "<python>print(122 * 4)</python>", "<answer>1</answer>"]
    one = train_tokenizer(texts, number_digits=1)
    assert pieces(one, "<answer>488</answer>") == ["<answer>", "4", "8", "8", "</answer>"]
    assert pieces(one, "12345") == ["1", "2", "3", "4", "5"]
    vocab = one.get_vocab()
    assert all(str(i) in vocab for i in range(10)) and "12" not in vocab and "122" not in vocab
    text = "<python>print(1000000 - 007)</python>"
    assert one.decode(one.encode(text, add_special_tokens=False)) == text
    one.save_pretrained(tmp_path)
    assert pieces(AutoTokenizer.from_pretrained(tmp_path), "699") == ["6", "9", "9"]
    with pytest.raises(ValueError, match="number_digits must be 1, 2 or 3"):
        train_tokenizer(["a"], number_digits=4)


def test_training_is_deterministic():
    a = train_tokenizer(["b a c a", "c"]).get_vocab()
    b = train_tokenizer(["c", "a c a b"]).get_vocab()
    assert a == b


def test_chat_template(tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Ok."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>hi<|end|>\n<|assistant|>Ok.<|end|>\n<|assistant|>"


def test_tiny_model_is_small_deterministic_and_tied(tokenizer):
    a, b = build_tiny_model(tokenizer, seed=1), build_tiny_model(tokenizer, seed=1)
    c = build_tiny_model(tokenizer, seed=2)
    assert sum(p.numel() for p in a.parameters()) < 3_000_000
    assert all(
        torch.equal(x, y)
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert a.lm_head.weight.data_ptr() == a.model.embed_tokens.weight.data_ptr()
    assert a.config.vocab_size == len(tokenizer)


def test_save_and_load_offline(tokenizer, tiny_model, tmp_path):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    save_policy(tiny_model, tokenizer, tmp_path / "ckpt")
    model, tok = load_policy(tmp_path / "ckpt")
    text = "<python>print(37 + 12)</python>"
    assert tok.encode(text, add_special_tokens=False) == tokenizer.encode(
        text, add_special_tokens=False
    )
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert (
        tok.chat_template == tokenizer.chat_template and tok.eos_token_id == tokenizer.eos_token_id
    )
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, tiny_model(ids).logits)
    # Plain Auto classes read the folder as it is.
    assert AutoTokenizer.from_pretrained(tmp_path / "ckpt").eos_token == "<|end|>"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").config.model_type == "llama"
