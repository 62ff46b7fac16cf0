"""UCT tree search over env actions (ALGORITHMS.md, "MCTS tree expansion (Agent-R)").

Engine- and env-independent: the caller supplies two callbacks and this module does the rest
(selection, expansion bookkeeping, dedupe, terminal handling, backup), for many trees at once.

    trees = [Tree(f"{t.task_id}:0", t.task_id, "craft", opening=opening_of(t)) for t in tasks]
    search(trees, expand, step, iterations=4, max_depth=10, n_gen=4, c=0.25, seed=0)
    rows = [row for tree in trees for row in to_rows(tree)]    # the ``trees`` contract
    tree = from_rows(rows_of_one_tree)                           # and back

- ``expand(leaves, n_gen) -> list[list[Child]]``: sample ``n_gen`` assistant turns for each leaf
  (``conversation(leaf)`` gives its chat and stored turn ids). It is called once per tree level
  with one leaf from every tree still searching, so the engine sees one batched call per level.
- ``step(node) -> (observation, reward, done, info)``: ``node`` is a new child, not yet stepped;
  restore the env to ``node.parent``'s state (snapshot, or reset + replay of ``path(node.parent)``)
  and step it with ``node.text``; an env error may be raised or returned. It may keep a snapshot
  in ``node.state`` (never written). Calls run in a thread pool, at most one at a time per tree,
  so one env per tree is enough.

Each iteration walks every tree from its root: descend by UCT through expanded nodes to an
unexpanded one, expand it (all trees together), step its children, back up the terminal ones,
and go on from it, until the walk reaches a terminal node. There is no random simulation phase:
values come only from terminal env rewards, so ``value`` is the mean reward of the terminal
leaves below a node and ``visits`` their count.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from flywheel.trajectory import Trajectory

Outcome = tuple[str, float, bool, dict[str, Any]]


@dataclass
class Child:
    """One sampled assistant turn, as ``expand`` returns it. ``action`` is the action the turn
    names (what identical samples are recognised by); "" means the whole text."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    action: str = ""

    @property
    def key(self) -> str:
        return self.action or self.text


@dataclass(eq=False)
class Node:
    """An env state: the root, or the state after the turn ``text`` from ``parent``."""

    tree: Tree = field(repr=False)
    node_id: int
    depth: int
    parent: Node | None = field(default=None, repr=False)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    action: str = ""
    observation: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    done: bool = False
    terminal: bool = False
    reward: float = 0.0
    success: bool = False
    visits: int = 0
    value: float = 0.0  # mean of the terminal rewards backed up through this node
    children: list[Node] = field(default_factory=list, repr=False)
    state: Any = field(default=None, repr=False)  # the caller's env snapshot; never written

    @property
    def expanded(self) -> bool:
        return bool(self.children)


@dataclass(eq=False)
class Tree:
    """One search tree; ``nodes[i]`` has ``node_id`` i and ``nodes[0]`` is the root. ``opening``
    is the conversation before the first policy turn (instruction, ``Ok.``, first observation)."""

    tree_id: str
    task_id: str
    env: str
    split: str = "train"
    seed: int = 0
    opening: list[dict[str, Any]] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list, repr=False)
    state: Any = field(default=None, repr=False)  # the caller's per-tree env handle

    def __post_init__(self) -> None:
        if not self.nodes:
            self.nodes.append(Node(tree=self, node_id=0, depth=0))

    @property
    def root(self) -> Node:
        return self.nodes[0]

    def add(self, parent: Node, child: Child) -> Node:
        """A new, not yet stepped child of ``parent``."""
        node = Node(
            tree=self,
            node_id=len(self.nodes),
            depth=parent.depth + 1,
            parent=parent,
            text=child.text,
            token_ids=list(child.token_ids),
            logprobs=list(child.logprobs),
            action=child.action,
        )
        self.nodes.append(node)
        parent.children.append(node)
        return node


ExpandFn = Callable[[list[Node], int], Sequence[Sequence[Child]]]
StepFn = Callable[[Node], Outcome | Exception]


# -- the UCT pieces -----------------------------------------------------------------------------


def uct(child: Node, parent_visits: int, c: float) -> float:
    """``Q/N + c * sqrt(ln N_parent / N)``, with ``Q/N`` the child's mean value; +inf unvisited."""
    if child.visits == 0:
        return math.inf
    return child.value + c * math.sqrt(math.log(parent_visits) / child.visits)


def select_child(node: Node, c: float, rng: random.Random) -> Node | None:
    """The non-terminal child with the highest UCT score, ties broken by ``rng``; None when
    every child is terminal."""
    best: list[Node] = []
    best_score = -math.inf
    for child in node.children:
        if child.terminal:
            continue
        score = uct(child, node.visits, c)
        if score > best_score:
            best, best_score = [child], score
        elif score == best_score:
            best.append(child)
    return rng.choice(best) if best else None


def backup(node: Node, reward: float) -> None:
    """Count one terminal ``reward`` on every node from ``node`` to the root; a node whose
    children are now all terminal becomes terminal (nothing left to search below it)."""
    current: Node | None = node
    while current is not None:
        current.visits += 1
        current.value += (reward - current.value) / current.visits  # running mean
        if current.children and all(ch.terminal for ch in current.children):
            current.terminal = True
        current = current.parent


def settle(node: Node, outcome: Outcome | Exception, max_depth: int) -> None:
    """Record the env's answer to ``node``'s turn and whether the node is terminal: the env
    ended the episode (its reward, clipped at 0), a negative reward (a dead end: 0), the max
    depth (0 unless the env ended it), or an env error (0, the error in ``info["error"]``)."""
    if isinstance(outcome, Exception):
        node.observation = f"{type(outcome).__name__}: {outcome}"
        node.info = {"error": node.observation}
        node.terminal, node.reward = True, 0.0
        return
    observation, reward, done, info = outcome
    node.observation, node.info, node.done = observation, dict(info or {}), bool(done)
    node.success = node.done and bool(node.info.get("success", False))
    reward = float(reward)
    if node.done:
        node.terminal, node.reward = True, max(reward, 0.0)
    elif reward < 0 or node.depth >= max_depth:
        node.terminal, node.reward = True, 0.0
    else:
        node.reward = reward


def descend(node: Node, c: float, rng: random.Random) -> Node | None:
    """From ``node``, follow UCT through expanded nodes to the next one to expand; None when
    the walk ends at a terminal node."""
    while not node.terminal and node.children:
        child = select_child(node, c, rng)
        if child is None:  # every child terminal: so is this node
            node.terminal = True
            return None
        node = child
    return None if node.terminal else node


def dedupe(samples: Sequence[Child]) -> list[Child]:
    """The samples with distinct actions (or texts), first occurrence kept."""
    seen: set[str] = set()
    kept = []
    for sample in samples:
        if sample.key not in seen:
            seen.add(sample.key)
            kept.append(sample)
    return kept


def _step_tree(step: StepFn, nodes: list[Node]) -> list[Outcome | Exception]:
    outcomes: list[Outcome | Exception] = []
    for node in nodes:  # one tree's children in turn: they share the tree's env
        try:
            outcomes.append(step(node))  # an env error raised, or returned
        except Exception as exc:  # one broken step must not stop the other trees
            outcomes.append(exc)
    return outcomes


def expand_level(
    leaves: list[Node],
    expand: ExpandFn,
    step: StepFn,
    *,
    n_gen: int,
    max_depth: int,
    pool: ThreadPoolExecutor,
) -> list[Node]:
    """Expand every leaf (one ``expand`` call), step the new children (trees in parallel),
    back up the terminal ones; the new children. A leaf with no samples becomes terminal, 0."""
    samples = expand(leaves, n_gen)
    if len(samples) != len(leaves):
        raise ValueError(f"expand returned {len(samples)} sample lists for {len(leaves)} leaves")
    by_tree: dict[int, list[Node]] = {}
    new: list[Node] = []
    for leaf, leaf_samples in zip(leaves, samples, strict=True):
        for sample in dedupe(leaf_samples):
            child = leaf.tree.add(leaf, sample)
            by_tree.setdefault(id(leaf.tree), []).append(child)
            new.append(child)
        if not leaf.children:
            leaf.terminal, leaf.reward = True, 0.0
            backup(leaf, 0.0)
    groups = list(by_tree.values())
    for group, outcomes in zip(
        groups, pool.map(lambda g: _step_tree(step, g), groups), strict=True
    ):
        for node, outcome in zip(group, outcomes, strict=True):
            settle(node, outcome, max_depth)
    for node in new:
        if node.terminal:
            backup(node, node.reward)
    return new


def search(
    trees: list[Tree],
    expand: ExpandFn,
    step: StepFn,
    *,
    iterations: int = 4,
    max_depth: int = 10,
    n_gen: int = 4,
    c: float = 0.25,
    seed: int = 0,
    env_workers: int = 8,
    on_level: Callable[[int, int], None] | None = None,
) -> None:
    """Run ``iterations`` UCT walks on every tree in lockstep (module docstring). Each walk
    expands at most ``max_depth`` levels, so ``expand`` is called at most
    ``iterations * max_depth`` times whatever the number of trees. ``on_level(iteration,
    leaves)`` is told after each batched expansion."""
    if max_depth < 1:
        raise ValueError(f"max_depth must be at least 1, got {max_depth}")
    rng = random.Random(seed)
    with ThreadPoolExecutor(max_workers=max(1, env_workers)) as pool:
        for iteration in range(iterations):
            cursors = [tree.root for tree in trees]
            while True:
                leaves = [leaf for leaf in (descend(n, c, rng) for n in cursors) if leaf]
                if not leaves:
                    break
                expand_level(leaves, expand, step, n_gen=n_gen, max_depth=max_depth, pool=pool)
                if on_level is not None:
                    on_level(iteration, len(leaves))
                cursors = leaves


# -- reading a tree -------------------------------------------------------------------------------


def path(node: Node) -> list[Node]:
    """The nodes from the root to ``node``, both included."""
    nodes = []
    current: Node | None = node
    while current is not None:
        nodes.append(current)
        current = current.parent
    return nodes[::-1]


def paths(tree: Tree) -> list[list[Node]]:
    """Every root-to-leaf path that ends at a terminal leaf, depth first in sampling order."""
    return [path(n) for n in tree.nodes if n.terminal and not n.children and n.parent]


def turns(steps: Sequence[Node], *, loss: bool, observe_done: bool = False) -> list[dict]:
    """Messages of consecutive steps: each turn (assistant, ``loss``) and its observation
    (user). A step that ended the episode has no observation, as in an agent-loop row, unless
    ``observe_done``."""
    messages: list[dict] = []
    for node in steps:
        messages.append({"role": "assistant", "content": node.text, "loss": loss})
        if observe_done or not node.done:
            messages.append({"role": "user", "content": node.observation, "loss": False})
    return messages


def conversation(node: Node) -> Trajectory:
    """The trajectory that leads to ``node``: the opening, then every turn and observation on its
    path, with the stored ids of its last generated turns (what ``expand`` sends the engine)."""
    steps = path(node)[1:]
    return Trajectory([dict(m) for m in node.tree.opening]) + Trajectory.from_turns(
        turns(steps, loss=True), [n.token_ids for n in steps], [n.logprobs for n in steps]
    )


def summary(trees: Sequence[Tree]) -> dict[str, float]:
    """Numbers for tracking: trees, mean nodes and depth per tree, share of trees with a
    successful leaf."""
    n = max(len(trees), 1)
    return {
        "trees": float(len(trees)),
        "nodes_per_tree": sum(len(t.nodes) for t in trees) / n,
        "max_depth_mean": sum(max(x.depth for x in t.nodes) for t in trees) / n,
        "success_share": sum(any(x.success for x in t.nodes) for t in trees) / n,
    }


# -- rows of the ``trees`` contract ---------------------------------------------------------------


def to_rows(tree: Tree) -> list[dict[str, Any]]:
    """One ``trees`` row per node, in ``node_id`` order."""
    return [
        {
            "tree_id": tree.tree_id,
            "task_id": tree.task_id,
            "env": tree.env,
            "split": tree.split,
            "seed": tree.seed,
            "node_id": n.node_id,
            "parent_id": n.parent.node_id if n.parent else -1,
            "depth": n.depth,
            "opening": [dict(m) for m in tree.opening] if n.parent is None else [],
            "text": n.text,
            "token_ids": list(n.token_ids),
            "logprobs": list(n.logprobs),
            "action": n.action,
            "observation": n.observation,
            "info": json.dumps(n.info, sort_keys=True, default=str),
            "done": n.done,
            "terminal": n.terminal,
            "reward": float(n.reward),
            "success": n.success,
            "visits": n.visits,
            "value": float(n.value),
        }
        for n in tree.nodes
    ]


def from_rows(rows: Sequence[dict[str, Any]]) -> Tree:
    """The tree of ``rows`` (one tree's rows, any order), as ``to_rows`` wrote it."""
    rows = sorted(rows, key=lambda r: r["node_id"])
    if not rows or rows[0]["parent_id"] != -1:
        raise ValueError("tree rows have no root (a row with parent_id -1)")
    first = rows[0]
    tree = Tree(
        tree_id=first["tree_id"],
        task_id=first["task_id"],
        env=first["env"],
        split=first["split"],
        seed=int(first["seed"]),
        opening=[dict(m) for m in first["opening"]],
    )
    tree.nodes.clear()
    for i, row in enumerate(rows):
        if row["tree_id"] != tree.tree_id:
            raise ValueError(f"rows of trees {tree.tree_id!r} and {row['tree_id']!r} mixed")
        if row["node_id"] != i:
            raise ValueError(f"tree {tree.tree_id!r} lacks node {i} (next is {row['node_id']})")
        if i and not 0 <= row["parent_id"] < i:
            raise ValueError(f"tree {tree.tree_id!r}: node {i} has parent {row['parent_id']}")
        parent = tree.nodes[row["parent_id"]] if i else None
        node = Node(
            tree=tree,
            node_id=i,
            depth=int(row["depth"]),
            parent=parent,
            text=row["text"],
            token_ids=list(row["token_ids"]),
            logprobs=list(row["logprobs"]),
            action=row["action"],
            observation=row["observation"],
            info=json.loads(row["info"]),
            done=bool(row["done"]),
            terminal=bool(row["terminal"]),
            reward=float(row["reward"]),
            success=bool(row["success"]),
            visits=int(row["visits"]),
            value=float(row["value"]),
        )
        tree.nodes.append(node)
        if parent is not None:
            parent.children.append(node)
    return tree


def trees_from_rows(rows: Sequence[dict[str, Any]]) -> list[Tree]:
    """Every tree of a ``trees`` table's rows, in order of first appearance."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        grouped.setdefault(row["tree_id"], []).append(row)
    return [from_rows(group) for group in grouped.values()]
