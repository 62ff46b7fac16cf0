"""The hf engine's prefix cache and early stop change the cost, not the result: multi-turn arith
episodes with ``prefix_cache`` on and off give the same trajectories, and the cached run's
log-probs match a plain forward pass over each whole episode.

    .venv/bin/python -m pytest tests/flywheel/engines/test_prefix_cache.py
"""

from __future__ import annotations

import pytest
import torch

from flywheel.agent import run_episodes
from flywheel.chat import encode_chat
from flywheel.engines.base import Chat, SamplingParams
from flywheel.engines.hf import HFEngine
from flywheel.envs.arith import ArithSuite
from flywheel.trajectory import align_turn_ids

GREEDY = SamplingParams(temperature=0, max_new_tokens=10)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=10, seed=5)


def episodes(engine, params):
    suite = ArithSuite()
    tasks = suite.tasks("train", 5, seed=1)
    return run_episodes(
        engine, suite, tasks, samples_per_task=2, sampling=params, max_steps=6, env_workers=2
    )


def full_forward_logprobs(model, tokenizer, row) -> list[float]:
    ids, mask = encode_chat(
        tokenizer, row["messages"], align_turn_ids(row["messages"], row["turn_token_ids"])
    )
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids)) if mask[i]]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_cache_on_and_off_give_the_same_episodes(tiny_model, tokenizer, params):
    # batch_size 3: every step spans several batches, mixing cached and shorter rows
    on = HFEngine(tiny_model, tokenizer, batch_size=3, prefix_cache=True)
    off = HFEngine(tiny_model, tokenizer, batch_size=3, prefix_cache=False)
    rows_on, rows_off = episodes(on, params), episodes(off, params)

    assert max(r["steps"] for r in rows_on) > 2  # multi-turn episodes, or nothing is reused
    assert on.stats["reused_tokens"] > on.stats["prompt_tokens"]  # most of each prompt reused
    assert off.stats["reused_tokens"] == 0
    assert on.stats["prompt_tokens"] + on.stats["reused_tokens"] == off.stats["prompt_tokens"]
    for a, b in zip(rows_on, rows_off, strict=True):
        assert a["messages"] == b["messages"]
        assert a["turn_token_ids"] == b["turn_token_ids"]
        assert a["finish_reason"] == b["finish_reason"] and a["reward"] == b["reward"]
        for lp_a, lp_b in zip(a["turn_logprobs"], b["turn_logprobs"], strict=True):
            assert lp_a == pytest.approx(lp_b, abs=1e-4)
    for row in rows_on:
        flat = [lp for turn in row["turn_logprobs"] for lp in turn]
        expected = full_forward_logprobs(tiny_model, tokenizer, row)
        assert flat == pytest.approx(expected, abs=1e-4)


def test_a_session_is_reused_only_where_the_prompt_still_matches(tiny_model, tokenizer):
    engine = HFEngine(tiny_model, tokenizer)
    first = [{"role": "user", "content": "What is 37 + 12?"}]
    gen = engine.generate([Chat(first, session="a")], GREEDY)[0]
    follow = [*first, {"role": "assistant", "content": gen.text}, {"role": "user", "content": "49"}]
    changed = [{"role": "user", "content": "What is 5 + 7?"}, *follow[1:]]
    before = dict(engine.stats)
    cached, other = engine.generate(
        [Chat(follow, [gen.token_ids], session="a"), Chat(changed, [gen.token_ids], session="b")],
        GREEDY,
    )
    reused = engine.stats["reused_tokens"] - before["reused_tokens"]
    prompt, _ = encode_chat(tokenizer, first, add_generation_prompt=True)
    assert reused == len(prompt) + len(gen.token_ids) - 1  # session a: its whole last turn
    fresh = HFEngine(tiny_model, tokenizer, prefix_cache=False)
    expect_cached, expect_other = fresh.generate(
        [Chat(follow, [gen.token_ids]), Chat(changed, [gen.token_ids])], GREEDY
    )
    assert cached.token_ids == expect_cached.token_ids
    assert cached.logprobs == pytest.approx(expect_cached.logprobs, abs=1e-4)
    assert other.token_ids == expect_other.token_ids
    # a session left out of a call is forgotten; close forgets the rest
    engine.generate([Chat(first, session="c")], GREEDY)
    assert set(engine._sessions) == {"c"}
    engine.close()
    assert engine._sessions == {}


def test_finished_rows_leave_the_batch(tiny_model, tokenizer):
    eos = tokenizer.eos_token_id

    class FirstRowStops(torch.nn.Module):
        """Row 0 of the first batch emits eos at once; records the batch size of every call."""

        def __init__(self) -> None:
            super().__init__()
            self.inner, self.generation_config = tiny_model, tiny_model.generation_config
            self.rows: list[int] = []

        def forward(self, **kw):
            out = self.inner(**kw)
            if not self.rows:
                out.logits[0, -1, :] = -10.0
                out.logits[0, -1, eos] = 10.0
            self.rows.append(out.logits.shape[0])
            return out

    model = FirstRowStops()
    chats = [Chat([{"role": "user", "content": "What is 37 + 12?"}])] * 3
    gens = HFEngine(model, tokenizer, share_prefill=False).generate(chats, GREEDY)
    assert gens[0].token_ids == [eos] and gens[0].finish_reason == "stop"
    assert model.rows[0] == 3 and set(model.rows[1:]) == {2}
    assert gens[1].token_ids == gens[2].token_ids and len(gens[1].token_ids) > 1


def test_sampling_after_rows_leave_draws_what_the_full_batch_would():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0)
    live = torch.tensor([1, 3, 4])
    for seed in range(20):
        full = HFEngine._choose(logits, params, torch.Generator().manual_seed(seed))
        part = HFEngine._choose(logits[live], params, torch.Generator().manual_seed(seed), live, 5)
        assert part.tolist() == full[live].tolist()
