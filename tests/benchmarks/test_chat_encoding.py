"""benchmarks/chat_encoding.py runs against the current flywheel.chat and envs, prints both ways,
and its check catches a resumed encoder that gives other ids."""

from __future__ import annotations

from benchmarks import chat_encoding
from flywheel.chat import PromptEncoder


def test_tiny_run_prints_both_ways_and_agrees(capsys):
    assert chat_encoding.compare("arith", 4, 16)
    printed = capsys.readouterr().out
    assert " scratch " in printed and " resumed " in printed
    assert "same prompt ids both ways: yes" in printed


def test_a_resumed_encoder_that_drops_a_token_is_caught(monkeypatch, capsys):
    prompt = PromptEncoder.prompt

    def one_short(self, messages, turn_token_ids=(), session=None):
        return prompt(self, messages, turn_token_ids, session)[:-1]

    monkeypatch.setattr(PromptEncoder, "prompt", one_short)
    assert not chat_encoding.compare("arith", 4, 16)
    assert "same prompt ids both ways: NO" in capsys.readouterr().out
