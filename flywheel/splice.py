"""Revision trajectories from MCTS trees (ALGORITHMS.md, "Revision splicing (Agent-R)").

A failed path of a tree is cut just after its first error, a revision turn is appended, and the
rest of a good path follows: the model learns to notice a mistake and recover. Pure functions on
``flywheel.mcts`` trees; no I/O and no engine calls (the ``splice`` stage makes those).

    for tree in trees:
        for k, rev in enumerate(select_revisions(tree, alpha=ALPHA, beta=BETA)):
            text = revision_turn(pick_thought(tree.tree_id, k), noop="inventory")
            rows.append(splice(rev.bad, rev.good, rev.cut, text, revision_observation=obs,
                              sample_idx=k))
        rows += [path_row(p, sample_idx=i) for i, p in enumerate(good_paths(tree, ALPHA))]

The first error is found by a verifier. The default reads env signals (``rule_flags``: a step
whose ``info`` says ``invalid``, ``error``, ``tool_error`` or ``lost_progress``). The other asks
the policy itself, one chat per step (a step's verdict depends only on its path, so one verdict
per node serves every path through it):

    nodes = judge_nodes(tree, alpha=ALPHA, beta=BETA)
    texts = generate([judge_chat(n) for n in nodes])               # the stage's engine call
    flags = judge_flags({n.node_id: parse_judgement(t) for n, t in zip(nodes, texts)})
    revisions = select_revisions(tree, alpha=ALPHA, beta=BETA, flags=flags)

Rows are trajectories rows without ``round`` and ``policy``, which the stage adds
(``stages._common.trajectory_rows``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flywheel.agent import derive_seed
from flywheel.mcts import Node, Tree, paths, turns
from flywheel.trajectory import Trajectory

# The published code reads both from the environment and has no defaults; these are the values
# this project starts from (config keys splice.alpha and splice.beta).
ALPHA = 0.5  # a good path's leaf value must exceed this
BETA = 0.2  # a pair's leaf values must differ by more than this
RULE_KEYS = ("invalid", "error", "tool_error", "lost_progress")

REVISION_THOUGHTS = (
    "I realize my previous actions were not leading to the goal; let me go back and try a "
    "different approach.",
    "That did not work as I expected. Let me reconsider what the task needs and change course.",
    "I made a mistake in the last step. Let me step back and take a different action.",
    "My recent actions are not getting me closer to the goal; I should rethink my plan.",
    "Looking at the observation, my last action was wrong. Let me revise my approach.",
    "I went down the wrong path. Let me return to what the task asks and try another way.",
    "This approach is failing. I will check my plan and correct it before going on.",
    "I should not keep going like this; let me reconsider and choose a better action.",
)

JUDGE_PROMPT = """You are checking one step of an agent working on a task.

Task:
{task}

Earlier steps:
{history}

Step to judge:
Action: {action}
Observation: {observation}

Does this step move the agent towards completing the task? Answer in one sentence, then end \
with exactly one line: "Judgement: Good", "Judgement: Bad" or "Judgement: Uncertain"."""

Flags = Callable[[Sequence[Node]], list[bool]]


@dataclass(frozen=True)
class Revision:
    """A bad path, the good path it is spliced onto, the index (among the bad path's steps,
    root excluded) of its first error, and how many steps the two paths share."""

    bad: list[Node]
    good: list[Node]
    cut: int
    divergence: int


# -- paths and pairs ------------------------------------------------------------------------------


def good_paths(tree: Tree, alpha: float = ALPHA) -> list[list[Node]]:
    """Paths whose leaf value exceeds ``alpha``; none from a tree whose root value is 0."""
    if tree.root.value <= 0:
        return []
    return [p for p in paths(tree) if p[-1].value > alpha]


def divergence(a: Sequence[Node], b: Sequence[Node]) -> int:
    """How many steps (nodes after the root) two paths of one tree share."""
    shared = 0
    while shared + 1 < min(len(a), len(b)) and a[shared + 1] is b[shared + 1]:
        shared += 1
    return shared


def _pairs(tree: Tree, alpha: float, beta: float) -> list[tuple[list[Node], list[list[Node]]]]:
    """Each path that has good partners (leaf value higher by more than ``beta``), with them."""
    goods = good_paths(tree, alpha)
    if not goods:
        return []
    found = []
    for bad in paths(tree):
        partners = [g for g in goods if g[-1].value - bad[-1].value > beta]
        if partners:
            found.append((bad, partners))
    return found


def select_revisions(
    tree: Tree, *, alpha: float = ALPHA, beta: float = BETA, flags: Flags | None = None
) -> list[Revision]:
    """One revision per bad path of ``tree`` (Agent-R's pairs, ALGORITHMS.md).

    Against a partner that shares ``d`` steps with it, the bad path's first error is its first
    flagged step at or after ``d`` (a flagged step inside the shared prefix was recovered from
    on the good path), else step ``d``, where the two part. Preferred partner: the sibling
    (the good path leaves at the error's parent, so the splice resumes from the state right
    before the error), then flagged errors, then the longest shared prefix, then the higher
    leaf value, then the first in sampling order."""
    flags = flags or rule_flags
    revisions = []
    for bad, partners in _pairs(tree, alpha, beta):
        steps = bad[1:]
        flagged = flags(steps)
        if len(flagged) != len(steps):
            raise ValueError(f"the verifier gave {len(flagged)} flags for {len(steps)} steps")
        options = []
        for order, good in enumerate(partners):
            d = divergence(bad, good)
            cut = next((i for i in range(d, len(steps)) if flagged[i]), d)
            key = (cut != d, not flagged[cut], -d, -good[-1].value, order)
            options.append((key, Revision(bad, good, cut, d)))
        revisions.append(min(options, key=lambda o: o[0])[1])
    return revisions


# -- verifiers ------------------------------------------------------------------------------------


def rule_flags(steps: Sequence[Node]) -> list[bool]:
    """Whether each step is an error by the env's own signals (``RULE_KEYS`` in its info)."""
    return [any(bool(node.info.get(key)) for key in RULE_KEYS) for node in steps]


def judge_nodes(tree: Tree, *, alpha: float = ALPHA, beta: float = BETA) -> list[Node]:
    """The distinct steps of the bad paths ``select_revisions`` would use: the ones to judge."""
    seen: dict[int, Node] = {}
    for bad, _ in _pairs(tree, alpha, beta):
        for node in bad[1:]:
            seen.setdefault(node.node_id, node)
    return list(seen.values())


def judge_chat(node: Node) -> list[dict[str, str]]:
    """The chat asking the policy whether ``node``'s step was Good, Bad or Uncertain, given
    the task and the steps before it."""
    task = next((m["content"] for m in reversed(node.tree.opening) if m["role"] == "user"), "")
    history = []
    current = node.parent
    while current is not None and current.parent is not None:
        history.append(
            f"Action: {current.action or current.text}\nObservation: {current.observation}"
        )
        current = current.parent
    prompt = JUDGE_PROMPT.format(
        task=task,
        history="\n".join(reversed(history)) or "(none)",
        action=node.action or node.text,
        observation=node.observation,
    )
    return [{"role": "user", "content": prompt}]


_JUDGEMENT = re.compile(r"judge?ment\W*(good|bad|uncertain)", re.IGNORECASE)


def parse_judgement(text: str) -> str:
    """``good``, ``bad`` or ``uncertain`` from the last ``Judgement:`` of a verifier answer;
    an answer without one is ``uncertain`` (the walk goes on, as on Uncertain)."""
    found = _JUDGEMENT.findall(text)
    return found[-1].lower() if found else "uncertain"


def judge_flags(verdicts: Mapping[int, str]) -> Flags:
    """Flags from the judge's verdicts by ``node_id``: only ``bad`` is an error."""
    return lambda steps: [verdicts.get(node.node_id) == "bad" for node in steps]


# -- trajectory rows ------------------------------------------------------------------------------


def revision_turn(thought: str, noop: str) -> str:
    """The revision turn: a reflection and an action that changes nothing in the env."""
    return f"Thought: {thought}\nAction: {noop}"


def pick_thought(*key: Any, thoughts: Sequence[str] = REVISION_THOUGHTS) -> str:
    """One of ``thoughts`` chosen by a stable hash of ``key`` (e.g. tree id and revision index)."""
    return thoughts[derive_seed("revision", *key) % len(thoughts)]


def unspellable(tokenizer: Any, texts: Sequence[str]) -> list[str]:
    """The words of ``texts`` the tokenizer encodes as its unknown token (none for a byte-level
    BPE; the embedded word-level tokenizer knows only the words it was trained on)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return []

    def unknown(text: str) -> bool:
        return unk in tokenizer.encode(text, add_special_tokens=False)

    found: list[str] = []
    for text in texts:
        if unknown(text):
            found += [word for word in text.split() if unknown(word)] or [text]
    return found


def _steps(nodes: Sequence[Node], *, loss: bool, observe_done: bool = False) -> Trajectory:
    """Consecutive steps as a piece of trajectory: their turns and observations (``turns``),
    with the ids and log-probs the policy generated them with."""
    return Trajectory.from_turns(
        turns(nodes, loss=loss, observe_done=observe_done),
        [node.token_ids for node in nodes],
        [node.logprobs for node in nodes],
    )


def _opening(
    tree: Tree, steps: Sequence[Node], leaf: Node, *, extra_turns: int, source: str, sample_idx: int
) -> Trajectory:
    """The tree's opening (not trained), with the trajectory columns that count over ``steps``
    (the env steps a row shows) or come from its last step ``leaf``; the caller appends the
    turns."""

    def count(key: str) -> int:
        return sum(bool(node.info.get(key)) for node in steps)

    columns = {
        "task_id": tree.task_id,
        "env": tree.env,
        "split": tree.split,
        "reward": float(leaf.reward),
        "success": bool(leaf.success),
        "steps": len(steps) + extra_turns,
        "tool_calls": count("tool_call"),
        "tool_errors": count("tool_error"),
        "tool_ok": count("tool_ok"),
        "invalid_actions": count("invalid"),
        "tokens": sum(len(node.token_ids) for node in steps),
        "finish_reason": "done" if leaf.done else "max_steps",
        "seed": tree.seed,
        "source": source,
        "sample_idx": sample_idx,
    }
    return Trajectory([{**m, "loss": False} for m in tree.opening], fields=columns)


def splice(
    bad: Sequence[Node],
    good: Sequence[Node],
    cut: int,
    text: str,
    *,
    revision_observation: str,
    sample_idx: int = 0,
) -> dict[str, Any]:
    """The revision trajectory: the opening, the bad path up to and including its first error
    (not trained), the revision turn ``text`` (trained) and ``revision_observation``, then the
    good path after the steps the two share (trained). Reward, success and finish come from the
    good leaf. The revision turn was not generated, so only the good continuation keeps stored
    ids (``Trajectory.__add__``)."""
    d = divergence(bad, good)
    if not d <= cut < len(bad) - 1:
        raise ValueError(
            f"cannot splice at step {cut}: the bad path has {len(bad) - 1} steps and shares "
            f"{d} with the good one (the cut must come after the shared steps)"
        )
    tree = bad[0].tree
    prefix, continuation = bad[1 : cut + 2], good[d + 1 :]
    revision = Trajectory(
        [
            {"role": "assistant", "content": text, "loss": True},
            {"role": "user", "content": revision_observation, "loss": False},
        ]
    )
    opening = _opening(
        tree, [*prefix, *continuation], good[-1],
        extra_turns=1, source="revision", sample_idx=sample_idx,
    )  # fmt: skip
    spliced = (
        opening
        + _steps(prefix, loss=False, observe_done=True)
        + revision
        + _steps(continuation, loss=True)
    )
    return spliced.to_row()


def path_row(path: Sequence[Node], *, source: str = "mcts", sample_idx: int = 0) -> dict[str, Any]:
    """A root-to-leaf path as a plain trajectory (every turn trained): the good paths that
    SFT mixes with the revisions."""
    tree, steps = path[0].tree, list(path[1:])
    opening = _opening(tree, steps, path[-1], extra_turns=0, source=source, sample_idx=sample_idx)
    return (opening + _steps(steps, loss=True)).to_row()
