"""flywheel.mcts: UCT scores by hand, backup and terminal propagation, dedupe, terminal and
max-depth handling, a toy search that must find the rewarded leaf, and trees rows round trip."""

from __future__ import annotations

import math
import random
import threading

import pytest

from data_contracts import table_from_rows, trees
from flywheel.mcts import (
    Child,
    Node,
    Tree,
    backup,
    conversation,
    from_rows,
    path,
    paths,
    search,
    select_child,
    settle,
    summary,
    to_rows,
    trees_from_rows,
    uct,
)

OPENING = [
    {"role": "user", "content": "Reach 3 with +1 and -1.", "loss": False},
    {"role": "assistant", "content": "Ok.", "loss": False},
    {"role": "user", "content": "You are at 0.", "loss": False},
]


def child(tree: Tree, parent: Node, visits: int, value: float, terminal: bool = False) -> Node:
    node = tree.add(parent, Child(f"turn {len(tree.nodes)}"))
    node.visits, node.value, node.terminal = visits, value, terminal
    return node


def test_uct_picks_the_child_the_formula_says():
    tree = Tree("t", "task", "toy")
    root = tree.root
    root.visits = 10
    a = child(tree, root, visits=4, value=0.5)
    b = child(tree, root, visits=2, value=0.0)
    c = child(tree, root, visits=4, value=0.25)
    # By hand: ln 10 = 2.302585; sqrt(ln10/4) = 0.758714, sqrt(ln10/2) = 1.072983.
    assert uct(a, 10, 0.25) == pytest.approx(0.5 + 0.25 * 0.758714, abs=1e-6)  # 0.689678
    assert uct(b, 10, 0.25) == pytest.approx(0.25 * 1.072983, abs=1e-6)  # 0.268246
    assert uct(c, 10, 0.25) == pytest.approx(0.25 + 0.25 * 0.758714, abs=1e-6)  # 0.439678
    rng = random.Random(0)
    assert select_child(root, 0.25, rng) is a  # exploitation wins at the published c
    assert uct(a, 10, 2.0) == pytest.approx(0.5 + 2 * 0.758714, abs=1e-6)  # 2.017427
    assert uct(b, 10, 2.0) == pytest.approx(2 * 1.072983, abs=1e-6)  # 2.145966
    assert select_child(root, 2.0, rng) is b  # a large c favours the least visited
    a.terminal = True
    assert select_child(root, 0.25, rng) is c  # terminal children are skipped
    d = child(tree, root, visits=0, value=0.0)
    assert uct(d, 10, 0.25) == math.inf
    assert select_child(root, 0.25, rng) is d  # unvisited first
    for node in (b, c, d):
        node.terminal = True
    assert select_child(root, 0.25, rng) is None


def test_ties_are_broken_at_random():
    tree = Tree("t", "task", "toy")
    first, second = (child(tree, tree.root, visits=0, value=0.0) for _ in range(2))
    picked = {select_child(tree.root, 0.25, random.Random(s)) for s in range(20)}
    assert picked == {first, second}


def test_backup_counts_visits_and_mean_value_along_the_path():
    tree = Tree("t", "task", "toy")
    a = child(tree, tree.root, 0, 0.0)
    b = child(tree, a, 0, 0.0)
    other = child(tree, tree.root, 0, 0.0)
    open_leaf = child(tree, b, 0, 0.0)
    win = child(tree, b, 0, 0.0, terminal=True)
    backup(win, 1.0)
    assert [(n.visits, n.value) for n in (win, b, a, tree.root)] == [(1, 1.0)] * 4
    loss = child(tree, a, 0, 0.0, terminal=True)
    backup(loss, 0.0)
    assert (loss.visits, loss.value) == (1, 0.0)
    assert (b.visits, b.value) == (1, 1.0)  # not on the second path
    assert (a.visits, a.value) == (2, 0.5)
    assert (tree.root.visits, tree.root.value) == (2, 0.5)
    assert other.visits == 0 and open_leaf.visits == 0
    assert not b.terminal and not a.terminal  # open_leaf is still to search
    open_leaf.terminal = True
    backup(open_leaf, 0.25)
    assert b.terminal and a.terminal  # every child terminal, all the way up
    assert not tree.root.terminal  # ``other`` is still open
    assert tree.root.value == pytest.approx((1.0 + 0.0 + 0.25) / 3)
    assert (b.visits, b.value) == (2, 0.625)


def test_settle_terminal_rules():
    tree = Tree("t", "task", "toy")

    def settled(outcome, depth_parent=tree.root, max_depth=3):
        node = tree.add(depth_parent, Child("x"))
        settle(node, outcome, max_depth)
        return node

    won = settled(("You won.", 1.0, True, {"success": True}))
    assert (won.terminal, won.done, won.reward, won.success) == (True, True, 1.0, True)
    lost = settled(("Dead.", -1.0, True, {}))
    assert (lost.terminal, lost.reward, lost.success) == (True, 0.0, False)
    disaster = settled(("Broke it.", -0.5, False, {"success": True}))
    assert (disaster.terminal, disaster.done, disaster.reward) == (True, False, 0.0)
    assert not disaster.success  # success only counts when the env ended the episode
    going = settled(("Fine.", 0.25, False, {"invalid": False}))
    assert (going.terminal, going.reward, going.info) == (False, 0.25, {"invalid": False})
    deep = tree.add(tree.add(going, Child("y")), Child("z"))
    assert deep.depth == 3
    settle(deep, ("Still going.", 0.5, False, {}), 3)
    assert (deep.terminal, deep.done, deep.reward) == (True, False, 0.0)  # max depth: 0
    ended = tree.add(deep.parent, Child("w"))
    settle(ended, ("Won at the last step.", 1.0, True, {"success": True}), 3)
    assert (ended.terminal, ended.reward, ended.success) == (True, 1.0, True)
    broken = settled(RuntimeError("env server gone"))
    assert (broken.terminal, broken.reward) == (True, 0.0)
    assert broken.info == {"error": "RuntimeError: env server gone"}


# -- the toy problem: start at 0, each turn says +1 or -1; 3 wins, -1 loses -------------------------


def position(node: Node) -> int:
    return sum(1 if n.action == "+1" else -1 for n in path(node)[1:])


class Toy:
    """A scripted policy (every expansion samples "+1", "-1", "+1", "-1" in some wording) and
    an env restored by replaying the path, which also checks one step at a time per tree."""

    def __init__(self, n_gen: int = 4):
        self.n_gen = n_gen
        self.calls: list[list[str]] = []  # tree ids of the leaves of each expand call
        self.in_flight: dict[str, int] = {}
        self.max_in_flight = 0
        self.lock = threading.Lock()

    def expand(self, leaves: list[Node], n: int) -> list[list[Child]]:
        assert n == self.n_gen
        self.calls.append([leaf.tree.tree_id for leaf in leaves])
        out = []
        for leaf in leaves:
            words = ["+1", "-1", "+1", "-1"][:n]
            out.append(
                [
                    Child(f"Thought: try {k}\nAction: {w}", [10 + k, 2], [-0.5, -0.25], action=w)
                    for k, w in enumerate(words)
                ]
            )
            traj = conversation(leaf)
            assert len(traj.turn_token_ids) == leaf.depth
            assert len(traj.messages) == len(OPENING) + 2 * leaf.depth
        return out

    def step(self, node: Node) -> tuple[str, float, bool, dict]:
        tree_id = node.tree.tree_id
        with self.lock:
            self.in_flight[tree_id] = self.in_flight.get(tree_id, 0) + 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight[tree_id])
        try:
            at = position(node)
            if at == 3:
                return "You reached 3.", 1.0, True, {"success": True}
            if at < 0:
                return "You fell below 0.", 0.0, True, {"success": False}
            return f"You are at {at}.", 0.0, False, {"progress": at}
        finally:
            with self.lock:
                self.in_flight[tree_id] -= 1


def toy_trees(n: int) -> list[Tree]:
    return [Tree(f"tree-{i}", f"task-{i}", "toy", seed=i, opening=OPENING) for i in range(n)]


def subtree_leaves(node: Node) -> list[Node]:
    if not node.children:
        return [node] if node.terminal else []
    return [leaf for ch in node.children for leaf in subtree_leaves(ch)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_search_finds_the_rewarded_leaf_with_one_batched_expand_per_level(seed):
    toy = Toy()
    forest = toy_trees(3)
    search(
        forest, toy.expand, toy.step, iterations=4, max_depth=5, n_gen=4, c=0.25, seed=seed,
        env_workers=4,
    )  # fmt: skip
    for tree in forest:
        wins = [p for p in paths(tree) if p[-1].success]
        assert wins, f"no path to 3 in {tree.tree_id}"
        assert all(position(p[-1]) == 3 for p in wins)
        assert wins[0][-1].reward == 1.0
        # Dedupe: each expansion sampled 4 turns naming 2 distinct actions.
        assert all(len(n.children) in (0, 2) for n in tree.nodes)
        # value = mean reward of the terminal leaves below, visits = their count.
        for node in tree.nodes:
            leaves = subtree_leaves(node)
            assert node.visits == len(leaves)
            if leaves:
                assert node.value == pytest.approx(sum(x.reward for x in leaves) / len(leaves))
        assert max(n.depth for n in tree.nodes) <= 5
    assert toy.calls[0] == ["tree-0", "tree-1", "tree-2"]  # the trees share each call
    assert len(toy.calls) <= 4 * 5
    assert sum(len(c) for c in toy.calls) == sum(
        sum(1 for n in t.nodes if n.children) for t in forest
    )  # every expanded node was expanded exactly once
    assert toy.max_in_flight == 1
    assert summary(forest)["success_share"] == 1.0


def test_max_depth_ends_the_search_when_every_leaf_is_terminal():
    calls = []

    def expand(leaves, n):
        calls.append(len(leaves))
        return [
            [Child("Action: left", action="left"), Child("Action: right", action="right")]
        ] * len(leaves)

    tree = Tree("t", "task", "toy", opening=OPENING)
    search(
        [tree], expand, lambda node: ("Nothing happens.", 0.5, False, {}), iterations=10,
        max_depth=2, seed=0,
    )  # fmt: skip
    assert calls == [1, 1, 1]  # root, then each depth-1 node; then the root is terminal
    assert len(tree.nodes) == 1 + 2 + 4
    deepest = [n for n in tree.nodes if n.depth == 2]
    assert all(n.terminal and not n.done and n.reward == 0.0 for n in deepest)
    assert [n.reward for n in tree.nodes if n.depth == 1] == [0.5, 0.5]  # the step's reward
    assert tree.root.terminal and (tree.root.visits, tree.root.value) == (4, 0.0)


def test_dedupe_by_action_or_text_and_empty_expansions():
    def expand(leaves, n):
        return [
            [
                Child("Thought: a\nAction: go", action="go"),
                Child("Thought: b\nAction: go", action="go"),  # same action, other words
                Child("Action: stop"),  # no action given: the text is the key
                Child("Action: stop"),
            ],
            [],  # nothing sampled: the leaf is a dead end
        ]

    first, second = Tree("a", "task", "toy"), Tree("b", "task", "toy")
    search([first, second], expand, lambda node: ("ok", 1.0, True, {}), iterations=1, max_depth=3)
    assert [n.text for n in first.root.children] == ["Thought: a\nAction: go", "Action: stop"]
    assert second.root.terminal and second.root.reward == 0.0 and second.root.visits == 1


def test_expand_must_answer_every_leaf():
    with pytest.raises(ValueError, match="expand returned 0 sample lists for 1 leaves"):
        search([Tree("t", "task", "toy")], lambda leaves, n: [], lambda node: ("", 0, True, {}))


def test_rows_round_trip_through_the_contract():
    toy = Toy()
    forest = toy_trees(2)
    search(forest, toy.expand, toy.step, iterations=3, max_depth=4, seed=0)
    forest[0].nodes[1].info = {"invalid": True, "error": "no such item", "progress": 0.5}
    rows = [row for tree in forest for row in to_rows(tree)]
    table = table_from_rows(trees.CONTRACT, rows)
    back = trees_from_rows(table.to_pylist())
    assert [t.tree_id for t in back] == ["tree-0", "tree-1"]
    assert [row for tree in back for row in to_rows(tree)] == rows
    rebuilt = back[0]
    assert rebuilt.opening == OPENING and rebuilt.nodes[1].info["error"] == "no such item"
    assert [len(p) for p in paths(rebuilt)] == [len(p) for p in paths(forest[0])]
    assert rows[0]["opening"] == OPENING and rows[1]["opening"] == []
    assert rows[0]["parent_id"] == -1 and rows[1]["parent_id"] == 0


def test_from_rows_rejects_mixed_or_broken_trees():
    toy = Toy()
    forest = toy_trees(2)
    search(forest, toy.expand, toy.step, iterations=1, max_depth=2)
    with pytest.raises(ValueError, match="mixed"):
        from_rows(to_rows(forest[0]) + to_rows(forest[1])[1:])
    with pytest.raises(ValueError, match="no root"):
        from_rows(to_rows(forest[0])[1:])


def test_conversation_gives_the_chat_and_the_last_generated_ids():
    tree = Tree("t", "task", "toy", opening=OPENING)
    a = tree.add(tree.root, Child("Action: +1", [5, 2], [-0.5, -0.5]))
    settle(a, ("You are at 1.", 0.0, False, {}), 5)
    b = tree.add(a, Child("Action: +1"))  # a turn with no stored ids (tokenized from text)
    settle(b, ("You are at 2.", 0.0, False, {}), 5)
    c = tree.add(b, Child("Action: +1", [7, 2], [-0.25, -0.5]))
    settle(c, ("You reached 3.", 1.0, True, {"success": True}), 5)
    traj = conversation(c)
    assert traj.messages == OPENING + [
        {"role": "assistant", "content": "Action: +1", "loss": True},
        {"role": "user", "content": "You are at 1.", "loss": False},
        {"role": "assistant", "content": "Action: +1", "loss": True},
        {"role": "user", "content": "You are at 2.", "loss": False},
        {"role": "assistant", "content": "Action: +1", "loss": True},
    ]  # the episode ended: no observation after the last turn
    assert traj.turn_token_ids == [[7, 2]]  # only the trailing run of turns with ids
    assert traj.turn_logprobs == [[-0.25, -0.5]]
    assert conversation(b).turn_token_ids == []
