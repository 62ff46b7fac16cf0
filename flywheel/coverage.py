"""What learning from its own successes cannot teach: ``flywheel coverage EXPLORE_ID``.

A policy bootstrapped on demonstrations writes the tokens those demonstrations taught it. A
task whose solution needs a token the demonstrations never write is one the policy has never
been trained to produce; its samples fail, so no success of the round contains that token and
the rounds' SFT steps, the ``rft`` baseline and every other method that imitates the policy's
own successes cannot teach it either. This module measures that on a real exploration:

- for each explored task with an oracle, the oracle's actions (the assistant turns a solution
  writes) are encoded with the exploring policy's tokenizer;
- each token's count is how often the demonstrations the policy was trained on (the ``expert``
  artifacts in its lineage, their trained assistant turns) write it;
- a task's *rarest* count is the smallest count among its solution's tokens; the tasks are
  grouped by it (never, 1-2, 3-5, 6+ times), with the share of each group that any sample
  solved and the number no sample solved.

On the embedded default (arith, every number below 1000 one token) about a fifth of the
explored tasks need a number the 500 demonstrations never write, and they are solved 0.8% of
the time (docs/results.md, "How far imitation goes"). Counting needs no model and no env step:
the oracle's actions and the tokenizer are enough.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flywheel.config import Config
    from flywheel.store import Store

# (label, smallest count, largest count or None): the groups of the report, in its order.
BUCKETS: tuple[tuple[str, int, int | None], ...] = (
    ("never", 0, 0),
    ("1-2 times", 1, 2),
    ("3-5 times", 3, 5),
    ("6+ times", 6, None),
)


def bucket_of(count: int) -> str:
    for label, low, high in BUCKETS:
        if count >= low and (high is None or count <= high):
            return label
    raise ValueError(f"a count is never negative, got {count}")


def token_counts(sequences: Iterable[Iterable[int]]) -> Counter[int]:
    """How often each token id occurs over ``sequences``."""
    counts: Counter[int] = Counter()
    for ids in sequences:
        counts.update(ids)
    return counts


def rarest(solution: Iterable[int], counts: Mapping[int, int]) -> int:
    """The smallest count among a solution's tokens (a solution with no token counts as seen)."""
    return min((counts.get(t, 0) for t in solution), default=max(counts.values(), default=0))


@dataclass
class Group:
    tasks: int = 0
    solved: int = 0

    @property
    def unsolved(self) -> int:
        return self.tasks - self.solved


def group_tasks(
    solutions: Mapping[str, list[int]], solved: Mapping[str, bool], counts: Mapping[int, int]
) -> dict[str, Group]:
    """Tasks grouped by their solution's rarest count (``BUCKETS``), each group's tasks and how
    many of them a sample solved; ``solutions`` and ``solved`` are keyed by task id."""
    groups = {label: Group() for label, _, _ in BUCKETS}
    for task_id, ids in solutions.items():
        g = groups[bucket_of(rarest(ids, counts))]
        g.tasks += 1
        g.solved += bool(solved.get(task_id, False))
    return groups


def format_groups(env: str, groups: Mapping[str, Group]) -> str:
    lines = [
        f"{env}: explored tasks by how often the demonstrations write the rarest token of the "
        "oracle's solution",
        f"  {'rarest token written':<22} {'tasks':>6} {'solved by a sample':>19} {'unsolved':>9}",
    ]
    total = Group()
    for label, g in groups.items():
        total.tasks += g.tasks
        total.solved += g.solved
        share = f"{g.solved / g.tasks:.1%}" if g.tasks else "-"
        lines.append(f"  {label:<22} {g.tasks:>6} {share:>19} {g.unsolved:>9}")
    share = f"{total.solved / total.tasks:.1%}" if total.tasks else "-"
    lines.append(f"  {'all':<22} {total.tasks:>6} {share:>19} {total.unsolved:>9}")
    return "\n".join(lines)


def _experts(store: Store, artifact_id: str) -> list[str]:
    """The expert artifacts in an artifact's lineage, each once, in the order first met."""
    found: list[str] = []
    stack = [store.lineage(artifact_id)]
    while stack:
        node = stack.pop()
        if node["stage"] == "expert" and node["id"] not in found:
            found.append(node["id"])
        stack.extend(reversed(node["inputs"]))
    return found


def coverage_report(cfg: Config, store: Store, artifact_id: str) -> str:
    """``flywheel coverage``: read an explore artifact and the demonstrations its policy was
    trained on, encode each explored task's oracle solution with the policy's tokenizer and
    group the tasks (``group_tasks``); the report's text."""
    from transformers import AutoTokenizer

    from flywheel.checkpoint import checkpoint_dir
    from flywheel.envs import has_oracle, make_suite
    from stages._common import load_tasks

    ref = store.get(artifact_id)
    if ref.stage != "explore":
        raise ValueError(
            f"{artifact_id} is a {ref.stage} artifact; coverage reads an explore artifact"
        )
    policy_id, tasks_id = ref.inputs
    rows = store.read(ref, columns=["env", "task_id", "success"]).to_pylist()
    envs = {e.name: e for e in cfg.envs}
    explored = sorted({row["env"] for row in rows})
    unknown = [env for env in explored if env not in envs]
    if unknown:
        raise ValueError(
            f"{artifact_id} explored env {unknown[0]!r}, which the config does not name"
        )
    experts = _experts(store, policy_id)
    if not experts:
        raise ValueError(f"{policy_id} was trained on no demonstrations (no expert artifact)")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir(store, store.get(policy_id)))

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    demos: list[dict[str, Any]] = []
    for expert in experts:
        demos += [r for r in store.read(expert, columns=["split", "env", "messages"]).to_pylist()
                  if r["split"] == "train"]  # fmt: skip
    out = [
        f"{artifact_id}: {len(rows)} samples from {policy_id}; demonstrations: "
        f"{', '.join(experts)} ({len(demos)} train tasks)"
    ]
    for env in explored:
        suite = make_suite(envs[env])
        if not has_oracle(suite):
            out.append(f"{env}: no oracle, nothing to compare with")
            continue
        counts = token_counts(
            encode(m["content"])
            for r in demos
            if r["env"] == env
            for m in r["messages"]
            if m["role"] == "assistant" and m["loss"]
        )
        solved: dict[str, bool] = {}
        for row in rows:
            if row["env"] == env:
                solved[row["task_id"]] = solved.get(row["task_id"], False) or bool(row["success"])
        tasks = [t for t in load_tasks(store, store.get(tasks_id), env=env, split="train")
                 if t.task_id in solved]  # fmt: skip
        solutions = {t.task_id: [i for a in suite.expert(t) for i in encode(a)] for t in tasks}
        out.append(format_groups(env, group_tasks(solutions, solved, counts)))
    out.append(
        "A token the demonstrations never write is one the policy was never trained to write: "
        "no success of its own contains it, so imitating its successes (round sft, rft) "
        "cannot teach it."
    )
    return "\n".join(out)
