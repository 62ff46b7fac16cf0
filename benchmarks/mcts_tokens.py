"""Benchmark: tokens the hf engine processes per expanded MCTS node, batched prefix-shared
expansion against a separate full-history call per child.

The nodes are craft states at depth 2, 4 and 8: for each of 16 craft tasks with a depth-4 goal
(whose oracle plan is longer than the deepest depth, so no node is terminal), the oracle's turns
are played in a real env and added as ``flywheel.mcts`` nodes, and ``mcts.conversation(node)``
gives the chat the search sends to the engine (instruction, ``Ok.``, recipes, then every action
and observation). Each node is expanded into ``n_gen`` children by a tiny random-init Llama
policy (a tokenizer trained on craft text), three ways:

- **shared**: one ``generate`` call with ``n_gen`` copies of every node's chat, ``share_prefill``
  on (what the mcts stage does: each node's prompt runs once, its children sample from it);
- **batched**: the same call with ``share_prefill`` off (same results, every copy prefilled);
- **separate**: one ``generate([chat])`` per child, no sharing, no session cache.

Tokens processed = prompt tokens run through the model + tokens generated (``engine.stats``),
divided by the nodes expanded. The tiny policy rarely stops early, so a child costs about
``--max-new-tokens`` (the demo config's 24) generated tokens in every variant; the prompt is
what sharing saves, so the ratio grows with depth. Token counts are exact; seconds are wall time
on a possibly shared machine. ``same`` checks that shared and batched gave the same ids.

    nice -n 10 .venv/bin/python -m benchmarks.mcts_tokens                      # 16 nodes a depth
    nice -n 10 .venv/bin/python -m benchmarks.mcts_tokens --nodes 4 --max-new-tokens 8
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from benchmarks._policy import tiny_policy
from flywheel.agent import ACK
from flywheel.engines.base import Chat, Generation, SamplingParams
from flywheel.engines.hf import HFEngine
from flywheel.envs.base import Task
from flywheel.envs.craft import CraftSuite
from flywheel.mcts import Child, Node, Tree, conversation

GOAL = 3.0  # issue 11: at least 3x fewer tokens per expanded node at depth 4 and beyond


def long_tasks(suite: CraftSuite, n: int, turns: int) -> list[Task]:
    """The first ``n`` tasks whose oracle plan has more than ``turns`` turns."""
    tasks = [t for t in suite.tasks("train", 8 * n, seed=0) if len(suite.expert(t)) > turns]
    if len(tasks) < n:
        raise SystemExit(f"only {len(tasks)} craft tasks have plans over {turns} turns")
    return tasks[:n]


def nodes_at(suite: CraftSuite, task: Task, depths: list[int]) -> dict[int, Node]:
    """The oracle's path through ``task`` as mcts nodes (real observations); the node at each
    depth."""
    env = suite.make()
    opening = [
        {"role": "user", "content": suite.instruction},
        {"role": "assistant", "content": ACK},
        {"role": "user", "content": env.reset(task)},
    ]
    tree = Tree(task.task_id, task.task_id, "craft", opening=opening)
    node, found = tree.root, {}
    for action in suite.expert(task)[: max(depths)]:
        node = tree.add(node, Child(text=action, action=action))
        node.observation, _, node.done, node.info = env.step(action)
        if node.depth in depths:
            found[node.depth] = node
    env.close()
    return found


def policy(suite: CraftSuite, tasks: list[Task], hidden: int, layers: int):
    """The tiny policy, its tokenizer trained on craft prompts and the oracle turns of ``tasks``."""
    prompts = suite.tasks("train", 200, seed=1)
    model, tokenizer = tiny_policy(
        suite, hidden=hidden, layers=layers, prompts=prompts, experts=tasks
    )
    return model.eval(), tokenizer


def expand(
    engine: HFEngine, chats: list[Chat], n_gen: int, params: SamplingParams, separate: bool
) -> tuple[list[Generation], float]:
    """``n_gen`` children of every chat: one call with the copies side by side, or one call
    per child (each with its own seed); the generations and the seconds taken."""
    start = time.perf_counter()
    if separate:
        gens = [
            engine.generate([chat], replace(params, seed=i * n_gen + j))[0]
            for i, chat in enumerate(chats)
            for j in range(n_gen)
        ]
    else:
        gens = engine.generate([chat for chat in chats for _ in range(n_gen)], params)
    return gens, time.perf_counter() - start


def processed(engine: HFEngine) -> int:
    return engine.stats["prompt_tokens"] + engine.stats["generated_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--nodes", type=int, default=16, help="nodes expanded per depth")
    parser.add_argument("--n-gen", type=int, default=4, help="children per expanded node")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    suite = CraftSuite(depth_weights=(0.0, 0.0, 0.0, 1.0))
    tasks = long_tasks(suite, args.nodes, max(args.depths))
    model, tokenizer = policy(suite, tasks, args.hidden, args.layers)
    paths = [nodes_at(suite, task, args.depths) for task in tasks]
    params = SamplingParams(
        temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=0
    )
    print(
        f"tiny Llama (hidden {args.hidden}, {args.layers} layers), craft depth-4 goals, "
        f"{args.nodes} nodes a depth, n_gen {args.n_gen}, {args.max_new_tokens} new tokens a "
        f"child, temperature {args.temperature}, {args.threads} thread(s)"
    )
    print(
        f"{'depth':>5} {'prompt':>6} {'shared tok/node':>15} {'separate tok/node':>17} "
        f"{'ratio':>6} {'goal':>4} {'shared s':>8} {'batched s':>9} {'separate s':>10} "
        f"{'same':>4}"
    )
    for depth in args.depths:
        nodes = [found[depth] for found in paths]
        chats = [conversation(node).chat() for node in nodes]
        engines = {
            "shared": HFEngine(model, tokenizer, prefix_cache=False, share_prefill=True),
            "batched": HFEngine(model, tokenizer, prefix_cache=False, share_prefill=False),
            "separate": HFEngine(model, tokenizer, prefix_cache=False, share_prefill=False),
        }
        runs = {
            name: expand(engine, chats, args.n_gen, params, separate=name == "separate")
            for name, engine in engines.items()
        }
        per_node = {name: processed(engine) / len(nodes) for name, engine in engines.items()}
        prompt = engines["batched"].stats["prompt_tokens"] / (len(nodes) * args.n_gen)
        ratio = per_node["separate"] / per_node["shared"]
        goal = "-" if depth < 4 else ("yes" if ratio >= GOAL else "NO")
        same = [g.token_ids for g in runs["shared"][0]] == [g.token_ids for g in runs["batched"][0]]
        print(
            f"{depth:>5} {prompt:>6.0f} {per_node['shared']:>15.0f} "
            f"{per_node['separate']:>17.0f} {ratio:>5.2f}x {goal:>4} {runs['shared'][1]:>8.2f} "
            f"{runs['batched'][1]:>9.2f} {runs['separate'][1]:>10.2f} {'yes' if same else 'NO':>4}"
        )


if __name__ == "__main__":
    main()
