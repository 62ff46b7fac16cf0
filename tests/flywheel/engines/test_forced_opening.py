"""A chat's ``opening`` (token ids forced at the start of the next assistant turn, e.g. a
reflection hint): the hf engine generates the rest as if it had sampled those ids itself, and the
openai engine sends them at the end of its token-id prompt (a real HTTP server on 127.0.0.1).
Either way the turn comes back whole: opening ids then generated ids, the opening's log-probs
0.0, the text decoded from all of them."""

from __future__ import annotations

import pytest

from flywheel.engines.base import Chat, SamplingParams
from flywheel.engines.hf import HFEngine
from flywheel.engines.openai import OpenAIEngine
from tests.flywheel.engines.scripted_server import ScriptedServer

LONG = [
    {"role": "user", "content": "Solve the task. Tom has 5 apples and buys 7 more."},
    {"role": "assistant", "content": "Ok."},
    {"role": "user", "content": "What is 37 + 12?"},
]
N = 10


@pytest.mark.parametrize("m", [1, 3, 6])
def test_hf_greedy_forced_on_its_own_first_ids_generates_the_same_rest(tiny_model, tokenizer, m):
    engine = HFEngine(tiny_model, tokenizer, batch_size=4)
    free = engine.generate([Chat(LONG)], SamplingParams(temperature=0, max_new_tokens=N))[0]
    assert len(free.token_ids) == N and free.forced == 0  # no end-of-turn: every id generated
    opening = free.token_ids[:m]
    # batched with an unforced chat, which must not change either
    forced, again = engine.generate(
        [Chat(LONG, opening=opening), Chat(LONG)],
        SamplingParams(temperature=0, max_new_tokens=N - m),
    )
    assert forced.token_ids == free.token_ids  # the opening, then the same remaining ids
    assert forced.forced == m and forced.logprobs[:m] == [0.0] * m
    assert forced.logprobs[m:] == pytest.approx(free.logprobs[m:], abs=1e-4)
    assert forced.text == free.text == tokenizer.decode(free.token_ids)
    assert again.token_ids == free.token_ids[: N - m]


def test_hf_next_turn_reuses_the_cache_of_a_forced_turn(tiny_model, tokenizer):
    """The session cache holds the opening like any prompt id: the next prompt, built from the
    stored opening + generated ids, is served from it and gives what a fresh engine gives."""
    opening = tokenizer.encode("Ok. Invalid action", add_special_tokens=False)
    params = SamplingParams(temperature=0, max_new_tokens=4)
    cached = HFEngine(tiny_model, tokenizer)
    turn = cached.generate([Chat(LONG, session="s", opening=opening)], params)[0]
    assert turn.token_ids[: len(opening)] == opening and turn.text.startswith("Ok. Invalid action")
    follow = LONG + [{"role": "assistant", "content": turn.text}, {"role": "user", "content": "49"}]
    ids = [[], turn.token_ids]
    reused = cached.stats["reused_tokens"]
    second = cached.generate([Chat(follow, ids, session="s")], params)[0]
    assert cached.stats["reused_tokens"] > reused
    fresh = HFEngine(tiny_model, tokenizer, prefix_cache=False)
    assert fresh.generate([Chat(follow, ids)], params)[0].token_ids == second.token_ids


def test_openai_sends_the_opening_in_the_prompt(tokenizer):
    opening = tokenizer.encode("<answer>", add_special_tokens=False)
    with ScriptedServer(end_id=tokenizer.eos_token_id) as server:
        engine = OpenAIEngine([server.url], tokenizer, backoff_s=0.01)
        try:
            plain, forced = engine.generate(
                [Chat(LONG), Chat(LONG, opening=opening)],
                SamplingParams(temperature=0, max_new_tokens=8),
            )
        finally:
            engine.close()
    # the scripted model answers a prompt's last three ids reversed, then the end id: the
    # forced turn's answer starts from the opening, so the server saw it at the prompt's end
    m = len(opening)
    generated = forced.token_ids[m:]
    assert forced.token_ids[:m] == opening and forced.forced == m
    assert generated[: min(m, 3)] == list(reversed(opening))[: min(m, 3)]
    assert generated != plain.token_ids and generated[-1] == tokenizer.eos_token_id
    assert forced.logprobs == [0.0] * m + [-0.5] * len(generated)
    assert forced.text == tokenizer.decode(forced.token_ids[:-1], skip_special_tokens=False)
    assert forced.finish_reason == "stop" and plain.forced == 0
