"""Benchmark: multi-turn rollouts through the hf engine with the prefix cache on and off.

The same arith episodes (up to 6 turns each) run through ``run_episodes`` twice per size, once
with ``prefix_cache=True`` (each episode's KV cache kept between turns: a turn runs only its new
tokens) and once with ``prefix_cache=False`` (every turn recomputes the whole prompt), on a tiny
random-init Llama policy built here with a tokenizer trained on arith text, as the tests do.
Prints episodes/s, generated tokens/s, the prompt tokens run through the model, and the on/off
ratio; and checks that both runs produced the same trajectories. The machine may be shared:
compare the ratios, not the absolute numbers.

    nice -n 10 .venv/bin/python -m benchmarks.multiturn                   # 64 and 256 episodes
    nice -n 10 .venv/bin/python -m benchmarks.multiturn --episodes 16 --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from benchmarks._policy import tiny_policy
from flywheel.agent import run_episodes
from flywheel.engines.base import SamplingParams
from flywheel.engines.hf import HFEngine
from flywheel.envs.arith import ArithSuite


def benchmark_policy(suite: ArithSuite, args: argparse.Namespace):
    """``--checkpoint``'s trained policy (announced on stdout), else the random tiny one."""
    if args.checkpoint:
        from flywheel.model import load_policy

        print(f"policy {args.checkpoint}: ", end="")
        return load_policy(args.checkpoint)
    model, tokenizer = tiny_policy(suite, hidden=args.hidden, layers=args.layers)
    return model.eval(), tokenizer


def run(engine: HFEngine, suite: ArithSuite, n: int, args: argparse.Namespace):
    tasks = suite.tasks("test", n, seed=7)
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    start = time.perf_counter()
    rows = run_episodes(
        engine, suite, tasks, sampling=sampling, max_steps=args.max_steps, seed=0, env_workers=8
    )
    return rows, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)"
    )
    parser.add_argument(
        "--checkpoint",
        help="a trained policy folder (e.g. the demo's SFT checkpoint) instead of the random "
        "tiny model: its turns are short and its episodes call the tool and answer",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    suite = ArithSuite()
    model, tokenizer = benchmark_policy(suite, args)
    print(
        f"tiny Llama (hidden {model.config.hidden_size}, {model.config.num_hidden_layers} layers), arith, up to "
        f"{args.max_steps} turns, {args.max_new_tokens} new tokens a turn, "
        f"temperature {args.temperature}, {args.threads} thread(s)"
    )
    header = (
        f"{'episodes':>8} {'cache':>5} {'seconds':>8} {'episodes/s':>10} {'gen tok/s':>10} "
        f"{'turns':>6} {'prompt tok run':>14} {'reused':>8} {'speed-up':>8}"
    )
    print(header)
    for n in args.episodes:
        results = {}
        for cache in (False, True):
            engine = HFEngine(model, tokenizer, prefix_cache=cache)
            rows, took = run(engine, suite, n, args)
            results[cache] = (rows, took)
            generated = sum(r["tokens"] for r in rows)
            turns = sum(r["steps"] for r in rows)
            ratio = results[False][1] / took if cache else 1.0
            print(
                f"{n:>8} {'on' if cache else 'off':>5} {took:>8.2f} {n / took:>10.1f} "
                f"{generated / took:>10.0f} {turns:>6} {engine.stats['prompt_tokens']:>14} "
                f"{engine.stats['reused_tokens']:>8} {ratio:>7.2f}x"
            )
        same = all(
            a["turn_token_ids"] == b["turn_token_ids"]
            for a, b in zip(results[True][0], results[False][0], strict=True)
        )
        print(f"{n:>8} same trajectories on and off: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
