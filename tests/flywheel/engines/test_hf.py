from __future__ import annotations

import time

import pytest
import torch

from flywheel.chat import encode_chat
from flywheel.engines.base import Chat, SamplingParams
from flywheel.engines.hf import HFEngine
from flywheel.model import save_policy

SHORT = Chat([{"role": "user", "content": "What is 37 + 12?"}])
LONG = Chat(
    [
        {"role": "user", "content": "Solve the task. " * 12},
        {"role": "assistant", "content": "Ok."},
        {"role": "user", "content": "Tom has 5 apples and buys 7 more."},
    ]
)
GREEDY = SamplingParams(temperature=0, max_new_tokens=12)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=12, seed=7)


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer):
    return HFEngine(tiny_model, tokenizer, batch_size=4)


def forward_logprobs(engine, chat, generation):
    prompt, _ = encode_chat(
        engine.tokenizer, chat.messages, chat.turn_token_ids, add_generation_prompt=True
    )
    ids = torch.tensor([prompt + generation.token_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(engine.model(ids).logits[0].float(), dim=-1)
    return [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(generation.token_ids)]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED])
def test_logprobs_match_a_plain_forward_pass(engine, params):
    for chat, gen in zip([SHORT, LONG], engine.generate([SHORT, LONG], params), strict=True):
        assert len(gen.token_ids) == len(gen.logprobs) > 0
        assert gen.logprobs == pytest.approx(forward_logprobs(engine, chat, gen), abs=1e-4)


def test_greedy_is_deterministic_and_padding_does_not_change_it(engine):
    alone = engine.generate([SHORT], GREEDY)[0]
    batched = engine.generate([LONG, SHORT, LONG], GREEDY)
    assert engine.generate([SHORT], GREEDY)[0] == alone
    assert batched[1].token_ids == alone.token_ids
    assert batched[1].logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    assert batched[0].token_ids == batched[2].token_ids


def test_seeded_sampling_is_reproducible(engine):
    chats = [SHORT, LONG] * 3  # more than one batch
    first = engine.generate(chats, SAMPLED)
    assert engine.generate(chats, SAMPLED) == first
    other = engine.generate(
        chats, SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=12, seed=8)
    )
    assert [g.token_ids for g in other] != [g.token_ids for g in first]


def test_stop_at_end_of_turn_and_length(tiny_model, tokenizer):
    eos = tokenizer.eos_token_id

    class EndsAtThird(torch.nn.Module):
        """Wraps the model so that every row emits eos at its third step."""

        def __init__(self) -> None:
            super().__init__()
            self.inner, self.generation_config, self.calls = (
                tiny_model,
                tiny_model.generation_config,
                0,
            )

        def forward(self, **kw):
            out = self.inner(**kw)
            self.calls += 1
            if self.calls == 3:
                out.logits[:, -1, :] = -10.0
                out.logits[:, -1, eos] = 10.0
            return out

    engine = HFEngine(EndsAtThird(), tokenizer)
    gen = engine.generate([SHORT], GREEDY)[0]
    assert gen.finish_reason == "stop" and len(gen.token_ids) == 3 and gen.token_ids[-1] == eos
    assert gen.text == tokenizer.decode(gen.token_ids[:-1])
    gen = HFEngine(tiny_model, tokenizer).generate(
        [SHORT], SamplingParams(temperature=0, max_new_tokens=5)
    )[0]
    assert gen.finish_reason == "length" and len(gen.token_ids) == 5


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    generator = torch.Generator().manual_seed(0)
    picks = {
        HFEngine._choose(logits, SamplingParams(temperature=1.0, top_p=0.5), generator).item()
        for _ in range(50)
    }
    assert picks == {0}
    picks = {
        HFEngine._choose(logits, SamplingParams(temperature=1.0, top_p=0.8), generator).item()
        for _ in range(200)
    }
    assert picks == {0, 1}


def test_from_pretrained_and_speed(tiny_model, tokenizer, tmp_path):
    save_policy(tiny_model, tokenizer, tmp_path)
    engine = HFEngine.from_pretrained(tmp_path, batch_size=256)
    chats = [Chat([{"role": "user", "content": f"What is {i} + {7 * i}?"}]) for i in range(200)]
    start = time.perf_counter()
    gens = engine.generate(chats, SamplingParams(temperature=1.0, max_new_tokens=16, seed=0))
    elapsed = time.perf_counter() - start
    tokens = sum(len(g.token_ids) for g in gens)
    print(f"hf engine: {tokens / elapsed:.0f} generated tokens/s (200 chats, tiny model)")
    assert len(gens) == 200 and tokens > 0
