"""Stage ``mcts``: one UCT search tree per training task, grown by the round's policy
(ALGORITHMS.md, "MCTS tree expansion (Agent-R)"); writes the ``trees`` contract.

The search itself is ``flywheel.mcts.search``; this module gives it its two callbacks:

- ``expand``: every leaf's chat (``flywheel.mcts.conversation``, stored turn ids spliced in),
  ``mcts.n_gen`` copies of each, all in ONE ``engine.generate`` call per tree level, however
  many trees a shard searches (an engine that shares identical prompts' prefill pays each
  leaf's prompt once);
- ``step``: each tree has its own env (``branchable``: native ``snapshot()/restore()``, else
  reset + replay); a child restores its parent's snapshot (kept in ``node.state``, never
  written) and steps its turn.

Both go through the agent loop's ``Episode`` (flywheel/agent.py): a tree's opening is an
episode opened on the tree's env, a leaf's chat is the chat of the episode resumed at the leaf,
and a child is the turn that episode takes and steps, as in every other rollout.

With ``mcts.n_tasks`` set, round r searches the r-th window of that many train tasks of each env,
as explore does. Written in shards of ``mcts.shard_size`` trees: killed in the middle, a rerun
keeps the finished shards and searches the rest (a shard's seed is its index). The summary
holds per env ``trees``, ``nodes_per_tree``, ``max_depth_mean`` and ``success_share`` (trees
with a successful leaf); ``tree.png`` in the artifact folder draws one tree (the tracker logs
it).

    flywheel stage mcts --round 1 iteration.data=[explore,mcts]
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from flywheel.agent import Episode, Turn, derive_seed
from flywheel.config import Config
from flywheel.engines.base import Engine, SamplingParams
from flywheel.envs import EnvSuite, Task
from flywheel.envs.snapshot import BranchingEnv, branchable
from flywheel.mcts import (
    Child,
    Node,
    Outcome,
    Tree,
    conversation,
    search,
    summary,
    to_rows,
    trees_from_rows,
)
from flywheel.metrics import flatten
from flywheel.progress import Progress, say
from flywheel.store import ArtifactRef, ArtifactWriter, Store
from stages._common import rollout_setup

PLOT = "tree.png"
LABEL_BOX = {"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8}


def artifact_config(cfg: Config, round: int) -> dict[str, Any]:
    """What the artifact id hashes: the search settings, engine and env settings, the seed, and
    the window of train tasks round ``round`` searches (with ``tasks: unsolved`` the explore
    artifact, an input, says which tasks; ``tasks`` is hashed only then, so window ids are
    those from before the field)."""
    return {
        "mcts": cfg.mcts.model_dump(exclude={"tasks"} if cfg.mcts.tasks == "window" else None),
        "engine": cfg.engine_dump(),
        "envs": cfg.envs_dump(),
        "seed": cfg.run.seed,
        "window": round - 1,
    }


def run(
    cfg: Config,
    store: Store,
    policy: ArtifactRef,
    tasks: ArtifactRef,
    *,
    round: int,
    explored: ArtifactRef | None = None,
    force: bool = False,
) -> ArtifactRef:
    """Search round ``round``'s trees; with ``mcts.tasks: unsolved``, ``explored`` (the round's
    explore artifact) says which tasks no sample solved, and only those get a tree."""
    mc = cfg.mcts
    unsolved = mc.tasks == "unsolved"
    if unsolved and explored is None:
        raise ValueError("mcts.tasks=unsolved needs the round's explore artifact")
    w = store.writer(
        "trees",
        stage="mcts",
        round=round,
        config=artifact_config(cfg, round),
        inputs=[policy.id, tasks.id] + ([explored.id] if unsolved and explored else []),
        force=force,
    )
    if w.cached:
        return w.ref
    with rollout_setup(
        cfg, store, policy, tasks, split="train",
        limit=None if unsolved else mc.n_tasks, window=0 if unsolved else round - 1,
        label="mcts", needs_logprobs=True,
    ) as (engine, _, tasks_by_env):  # fmt: skip
        if unsolved and explored is not None:
            tasks_by_env = unsolved_tasks(store, explored, tasks_by_env, limit=mc.n_tasks)
        plan = [
            (suite, chunk[start : start + mc.shard_size])
            for suite, chunk in tasks_by_env
            for start in range(0, len(chunk), mc.shard_size)
        ]
        _search_shards(cfg, w, engine, plan, round=round)
    trees = trees_from_rows(w.read_shards().to_pylist())
    by_env: dict[str, list[Tree]] = {}
    for tree in trees:
        by_env.setdefault(tree.env, []).append(tree)
    if trees:
        plot_tree(pick_tree(trees), w.local_dir() / PLOT)
    return w.commit(summary=flatten({env: summary(group) for env, group in by_env.items()}))


def unsolved_tasks(
    store: Store,
    explored: ArtifactRef,
    tasks_by_env: list[tuple[EnvSuite, list[Task]]],
    *,
    limit: int | None,
) -> list[tuple[EnvSuite, list[Task]]]:
    """Each env's explored tasks that none of the explore artifact's samples solved, in the
    train split's order, the first ``limit`` of them per env (all with None)."""
    rows = store.read(explored, columns=["env", "task_id", "success"]).to_pylist()
    seen: dict[str, set[str]] = {}
    solved: dict[str, set[str]] = {}
    for row in rows:
        seen.setdefault(row["env"], set()).add(row["task_id"])
        if row["success"]:
            solved.setdefault(row["env"], set()).add(row["task_id"])
    picked = []
    for suite, tasks in tasks_by_env:
        left = seen.get(suite.name, set()) - solved.get(suite.name, set())
        chosen = [t for t in tasks if t.task_id in left][:limit]
        say(
            f"mcts: {suite.name}: {len(chosen)} of the {len(left)} tasks no explored sample "
            f"solved (of {len(seen.get(suite.name, ()))} explored)"
        )
        picked.append((suite, chosen))
    return picked


def _search_shards(
    cfg: Config,
    writer: ArtifactWriter,
    engine: Engine,
    plan: list[tuple[EnvSuite, list[Task]]],
    *,
    round: int,
) -> None:
    """Search and write every shard of ``plan`` the writer does not have yet, one line each."""
    finished = set(writer.finished_shards())
    if finished:
        say(f"mcts: resuming, {len(finished)}/{len(plan)} shards already written")
    total = sum(len(chunk) for _, chunk in plan)
    kept = sum(len(chunk) for i, (_, chunk) in enumerate(plan) if i in finished)
    with Progress("mcts:", total, unit="trees", done=kept) as bar:
        for index, (suite, chunk) in enumerate(plan):
            if index in finished:
                continue
            t0 = time.time()
            seed = derive_seed(cfg.run.seed, "mcts", round, index)
            trees = search_trees(cfg, engine, suite, chunk, seed=seed)
            writer.write_shard(index, [row for tree in trees for row in to_rows(tree)])
            tokens = sum(len(n.token_ids) for t in trees for n in t.nodes)
            bar.update(len(trees), tokens=tokens)
            nodes = sum(len(t.nodes) for t in trees)
            ok = sum(any(n.success for n in t.nodes) for t in trees) / max(len(trees), 1)
            bar.note(
                f"mcts: shard {index + 1}/{len(plan)} {suite.name}: {len(trees)} trees, "
                f"{nodes} nodes, trees with a success {ok:.1%}, {time.time() - t0:.1f}s"
            )


def search_trees(
    cfg: Config, engine: Engine, suite: EnvSuite, tasks: list[Task], *, seed: int
) -> list[Tree]:
    """One searched tree per task, every tree of a wave of envs searched together (a suite
    that holds few episodes open at once, ``max_open_episodes``, searches in waves)."""
    _check_opening(suite)
    mc = cfg.mcts
    wave = int(getattr(suite, "max_open_episodes", None) or len(tasks) or 1)
    trees: list[Tree] = []
    for start in range(0, len(tasks), wave):
        with _open_trees(suite, tasks[start : start + wave], seed) as group:
            search(
                group,
                _expander(cfg, engine, seed=derive_seed(seed, start)),
                _step,
                iterations=mc.iterations,
                max_depth=mc.max_depth,
                n_gen=mc.n_gen,
                c=mc.c,
                seed=derive_seed(seed, "uct", start),
                env_workers=cfg.engine.env_workers,
            )
            trees += group
    return trees


def _check_opening(suite: EnvSuite) -> None:
    """Refuse an env that writes its own opening (a workflow: its first model call happens in
    ``reset_messages``), which a tree's root cannot hold."""
    env = suite.make()
    try:
        if callable(getattr(env, "reset_messages", None)):
            raise ValueError(
                f"mcts: env {suite.name} writes its own opening (a workflow env); the search "
                "needs instruction + observation episodes"
            )
    finally:
        env.close()


@dataclass
class Branch:
    """What a tree's ``state`` holds: its task, and its env (each node keeps a snapshot)."""

    task: Task
    env: BranchingEnv


def plant(suite: EnvSuite, task: Task, seed: int) -> Tree:
    """A tree for ``task`` whose root holds the reset env's snapshot: the opening is the one
    the agent loop writes (instruction, ``Ok.``, first observation). Close ``tree.state.env``."""
    env = branchable(suite.make)
    ep = Episode(task=task, session=None)
    failure = ep.open(suite, env=env)
    if failure is not None:
        env.close()
        raise failure
    tree = Tree(
        f"{task.task_id}:0", task.task_id, suite.name, task.split, seed, opening=ep.messages
    )
    tree.state, tree.root.state = Branch(task, env), env.snapshot()
    return tree


@contextmanager
def _open_trees(suite: EnvSuite, tasks: list[Task], seed: int) -> Iterator[list[Tree]]:
    """A tree per task (``plant``); every env closed on exit."""
    with ExitStack() as stack:
        trees = []
        for task in tasks:
            tree = plant(suite, task, seed)
            stack.callback(tree.state.env.close)
            trees.append(tree)
        yield trees


def episode_at(node: Node, env: BranchingEnv | None = None) -> Episode:
    """The episode that reached ``node``: the chat on its path, the stored ids of its turns,
    and ``env`` (already restored to ``node``'s state) when it is to go on. No engine session:
    the tree's chats are not one episode's turns in a row."""
    traj = conversation(node)
    return Episode.resume(
        node.tree.state.task,
        traj.messages,
        traj.turn_token_ids,
        traj.turn_logprobs,
        env=env,
        session=None,
    )


def _expander(cfg: Config, engine: Engine, *, seed: int):
    """``expand`` for ``search``: n_gen copies of every leaf's chat in one generate call, the
    call's sampling seed derived from ``seed`` and the call's count (a rerun samples the same)."""
    sampling = SamplingParams(
        temperature=cfg.mcts.temperature, max_new_tokens=cfg.engine.max_new_tokens
    )
    calls = [0]

    def expand(leaves: list[Node], n_gen: int) -> list[list[Child]]:
        chats = []
        for leaf in leaves:
            chats += [episode_at(leaf).chat()] * n_gen  # one prefill where shared
        params = replace(sampling, seed=derive_seed(seed, "level", calls[0]))
        calls[0] += 1
        gens = engine.generate(chats, params) if chats else []
        return [
            [
                Child(g.text, list(g.token_ids), list(g.logprobs), action=action_of(g.text))
                for g in gens[i * n_gen : (i + 1) * n_gen]
            ]
            for i in range(len(leaves))
        ]

    return expand


def _step(node: Node) -> Outcome | Exception:
    """``step`` for ``search``: the tree's env back at the parent's state, then the episode
    there takes the node's turn and steps it (the env's error, if it raised)."""
    assert node.parent is not None  # search steps new children only
    env = node.tree.state.env
    env.restore(node.parent.state)
    ep = episode_at(node.parent, env)
    ep.take(Turn(node.text, node.token_ids, node.logprobs))
    outcome = ep.step()
    if not isinstance(outcome, Exception):
        node.state = env.snapshot()
    return outcome


def action_of(text: str) -> str:
    """The action a ReAct turn names: the first non-empty line after its last ``Action:``,
    spaces collapsed; "" when it has no ``Action:`` (then the whole text is the dedupe key)."""
    _, marker, after = text.rpartition("Action:")
    if not marker:
        return ""
    return next((" ".join(line.split()) for line in after.splitlines() if line.strip()), "")


# -- the picture ----------------------------------------------------------------------------------


def pick_tree(trees: list[Tree]) -> Tree:
    """The tree worth drawing: the largest one with a successful leaf, else the largest."""
    return max(trees, key=lambda t: (any(n.success for n in t.nodes), len(t.nodes)))


def _layout(tree: Tree) -> dict[int, tuple[float, float]]:
    """(x, y) per node id: leaves spread left to right in sampling order, a parent centred
    over its children, depth downwards."""
    xy: dict[int, tuple[float, float]] = {}
    next_x = [0.0]

    def place(node: Node) -> float:
        if node.children:
            xs = [place(child) for child in node.children]
            x = (xs[0] + xs[-1]) / 2
        else:
            x, next_x[0] = next_x[0], next_x[0] + 1.0
        xy[node.node_id] = (x, -float(node.depth))
        return x

    place(tree.root)
    return xy


def _color(node: Node) -> str:
    if node.children:
        return "#4c72b0"  # expanded
    if node.success:
        return "#2ca02c"
    return "#d62728" if node.terminal else "#bbbbbb"


def plot_tree(tree: Tree, path: Path) -> None:
    """Draw ``tree``: an edge per sampled turn, a node per env state (blue: expanded; leaves
    green: success, red: ended without it, grey: not searched further), sized by visits and
    labelled with its value; the actions of a small tree are written along its edges."""
    from matplotlib.figure import Figure  # heavy import; the Agg canvas, no pyplot state

    xy = _layout(tree)
    leaves = sum(1 for n in tree.nodes if not n.children)
    depth = max(n.depth for n in tree.nodes)
    fig = Figure(figsize=(min(4 + 0.6 * leaves, 24), 2 + 1.0 * depth))
    ax = fig.subplots()
    label_edges = len(tree.nodes) <= 40
    for node in tree.nodes[1:]:
        assert node.parent is not None
        (x0, y0), (x1, y1) = xy[node.parent.node_id], xy[node.node_id]
        ax.plot([x0, x1], [y0, y1], color="#999999", linewidth=0.8, zorder=1)
        if label_edges:  # near the child, where sibling edges have spread apart
            text = (node.action or node.text).replace("\n", " ")[:28]
            ax.text(x0 + 0.7 * (x1 - x0), y0 + 0.7 * (y1 - y0), text, fontsize=6,
                    ha="center", va="center", color="#333333", zorder=3, bbox=LABEL_BOX)  # fmt: skip
    ax.scatter([xy[n.node_id][0] for n in tree.nodes], [xy[n.node_id][1] for n in tree.nodes],
               s=[30 + 20 * n.visits for n in tree.nodes], c=[_color(n) for n in tree.nodes],
               zorder=2, linewidths=0)  # fmt: skip
    for node in tree.nodes:
        x, y = xy[node.node_id]
        ax.text(x, y - 0.12, f"{node.value:.2f}", fontsize=6, ha="center", va="top")
    ax.set_title(
        f"{tree.tree_id}: {len(tree.nodes)} nodes, root value {tree.root.value:.2f} over "
        f"{tree.root.visits} leaves (blue: expanded; leaves green: success, red: failed, "
        "grey: open)",
        fontsize=9,
    )
    ax.set_yticks([-d for d in range(depth + 1)], [str(d) for d in range(depth + 1)])
    ax.set_ylabel("depth")
    ax.set_xticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
