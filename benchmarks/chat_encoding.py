"""Benchmark: encoding the prompts of multi-turn episodes, from scratch at every turn
(``encode_chat``) against resumed per episode (``PromptEncoder``, what the hf engine uses).

Episodes are the expert's, played through the real env (arith: 1-4 turns; craft: up to 16), so
the conversations are the ones rollouts encode. For every turn of every episode both ways encode
the prompt before it, each timed over all episodes turn by turn (as a rollout asks for them: one
turn of every live episode, then the next), after an untimed warm-up, three times each way
(alternating; the fastest run counts). Prints the seconds, prompts encoded per second, the
template renders each way and the from-scratch / resumed ratio, and checks that the ids are the
same. The machine may be shared: compare the ratios, not the absolute numbers.

With ``--checkpoint`` (a trained arith policy, e.g. the demo's SFT checkpoint) it also runs
greedy arith test episodes end to end through the hf engine, three times each way (alternating,
after an untimed warm-up), with the engine's prompts encoded from scratch and resumed, and
checks the turns are the same.

    nice -n 10 .venv/bin/python -m benchmarks.chat_encoding                   # arith and craft
    nice -n 10 .venv/bin/python -m benchmarks.chat_encoding --episodes 64 --envs arith
    nice -n 10 .venv/bin/python -m benchmarks.chat_encoding --envs arith \
        --checkpoint work/store/default/round-0/sft/sft-<id>
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks._policy import policy_texts
from flywheel.agent import Episode, Turn
from flywheel.chat import PromptEncoder, encode_chat
from flywheel.config import EnvConfig
from flywheel.envs import make_suite
from flywheel.model import train_tokenizer


def expert_turns(suite, n: int, max_steps: int) -> list[list[tuple[list[dict], int]]]:
    """Per episode, the (messages, session) before each of the expert's turns."""
    episodes = []
    for session, task in enumerate(suite.tasks("test", n, seed=7)):
        episode = Episode(task, session=session)
        if episode.open(suite, expert=True) is not None:
            raise RuntimeError(f"{task.task_id}: the env did not open")
        turns = []
        for action in episode.script[:max_steps]:
            turns.append(([dict(m) for m in episode.messages], session))
            episode.take(Turn(action))
            if not episode.observe(episode.step()):
                break
        episode.env.close()  # type: ignore[union-attr]
        episodes.append(turns)
    return episodes


def by_turn(episodes):
    """Turn 0 of every episode, then turn 1 of those that have one, ... (a rollout's order)."""
    longest = max(len(e) for e in episodes)
    return [e[t] for t in range(longest) for e in episodes if t < len(e)]


def compare(name: str, n: int, max_steps: int, repeats: int = 3) -> bool:
    """Print both ways' rows for one env; whether they gave the same ids."""
    suite = make_suite(EnvConfig(name=name))
    tokenizer = train_tokenizer(policy_texts(suite))
    prompts = by_turn(expert_turns(suite, n, max_steps))
    renders = [0]
    original = tokenizer.apply_chat_template

    def counting(conversation, **kw):
        renders[0] += 1
        return original(conversation, **kw)

    tokenizer.apply_chat_template = counting
    encoder = PromptEncoder(tokenizer)
    ways = {
        "scratch": lambda m, s: encode_chat(tokenizer, m, add_generation_prompt=True)[0],
        "resumed": lambda m, s: encoder.prompt(m, session=s),
    }
    for messages, _ in prompts[:8]:  # warm-up, untimed: the template's compilation and caches
        encode_chat(tokenizer, messages, add_generation_prompt=True)
    results, renders_by_way = {}, {}
    took = {way: float("inf") for way in ways}
    for _ in range(repeats):  # alternating; each way's fastest run counts
        for way, encode in ways.items():
            encoder.keep_only(set())  # every repeat starts with no session kept
            renders[0] = 0
            start = time.perf_counter()
            results[way] = [encode(m, s) for m, s in prompts]
            took[way] = min(took[way], time.perf_counter() - start)
            renders_by_way[way] = renders[0]
    for way in ways:
        print(
            f"{name:>6} {n:>8} {len(prompts):>8} {way:>8} {took[way]:>8.2f} "
            f"{len(prompts) / took[way]:>10.0f} {renders_by_way[way]:>8} "
            f"{took['scratch'] / took[way]:>7.2f}x"
        )
    same = results["scratch"] == results["resumed"]
    print(f"{name:>6} same prompt ids both ways: {'yes' if same else 'NO'}")
    return same


class _Scratch(PromptEncoder):
    """Every prompt encoded from the start, as before ``PromptEncoder`` existed."""

    def prompt(self, messages, turn_token_ids=(), session=None):
        return encode_chat(self.tokenizer, messages, turn_token_ids, add_generation_prompt=True)[0]


def episodes_end_to_end(checkpoint: str, n: int) -> bool:
    """Greedy arith test episodes through the hf engine, prompts from scratch and resumed."""
    from flywheel.agent import run_episodes
    from flywheel.engines.base import SamplingParams
    from flywheel.engines.hf import HFEngine
    from flywheel.model import load_policy

    model, tokenizer = load_policy(checkpoint)
    engine = HFEngine(model, tokenizer)
    suite = make_suite(EnvConfig(name="arith"))
    tasks = suite.tasks("test", n, seed=7)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=24, seed=0)
    print(f"{'episodes':>8} {'way':>8} {'seconds':>8} {'episodes/s':>10} {'speed-up':>8}")
    took: dict[str, list[float]] = {"scratch": [], "resumed": []}
    turns = []
    run_episodes(engine, suite, tasks[:32], sampling=sampling, max_steps=6, seed=0)  # warm-up
    for way in ("scratch", "resumed") * 3:
        engine._encoder = _Scratch(tokenizer) if way == "scratch" else PromptEncoder(tokenizer)
        start = time.perf_counter()
        rows = run_episodes(engine, suite, tasks, sampling=sampling, max_steps=6, seed=0)
        took[way].append(time.perf_counter() - start)
        turns.append([r["turn_token_ids"] for r in rows])
        best = min(took[way])
        ratio = min(took["scratch"]) / best
        print(f"{n:>8} {way:>8} {took[way][-1]:>8.2f} {n / best:>10.1f} {ratio:>7.2f}x")
    same = all(t == turns[0] for t in turns)
    print(f"{n:>8} same turns every run: {'yes' if same else 'NO'} (episodes/s: the faster run)")
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--envs", nargs="+", default=["arith", "craft"])
    parser.add_argument("--max-steps", type=int, default=16)
    parser.add_argument("--checkpoint", help="a trained arith policy: also time whole episodes")
    args = parser.parse_args()
    print(
        f"{'env':>6} {'episodes':>8} {'prompts':>8} {'way':>8} {'seconds':>8} {'prompts/s':>10} "
        f"{'renders':>8} {'speed-up':>8}"
    )
    same = [compare(name, args.episodes, args.max_steps) for name in args.envs]
    if args.checkpoint:
        same.append(episodes_end_to_end(args.checkpoint, args.episodes))
    if not all(same):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
