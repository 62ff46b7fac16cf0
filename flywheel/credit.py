"""Where a round's policy-gradient signal lands: ``flywheel credit EXPLORE_ID``.

GRPO gives every generated token of a trajectory its group advantage
``A = (R - mean_group) / (std_group + 1e-6)``. Two samples of one task that generated the same
tokens so far share the same context for the next token too (the env answers the same actions
the same way), so their weights on it add up: a correct prefix that a failure shares with a
success of its group is pushed down by one and up by the other. This module measures that on a
real exploration artifact:

- **departure**: each sample is compared token by token with the env's oracle trajectory for the
  same task (both encoded the way training encodes them); its departure is the first token where
  they differ, and the tokens before it lie on the oracle's path. On an env whose turns are
  actions only (arith), the departure of a failed sample is where it first went wrong; on an
  env whose turns carry free text (craft's thoughts), it is the first word that differs.
- **mass**: per group whose rewards differ (the groups GRPO can learn from), every trained token
  position is a node of the group's prefix tree (same context, same token). A node's *net*
  weight is the sum of the advantages of the samples through it; the *gross* weight is the sum
  of their absolute values. ``1 - net / gross`` is the share that cancels inside the group.
- **greedy**: whether, at a failed sample's departure, the policy's own first choice (its
  argmax) leaves the oracle's path too. Test episodes decode greedily, so a slip where greedy
  decoding would follow the oracle changes no test episode however hard it is pushed down.

Pure functions on encoded samples; the command (flywheel/cli.py) reads the artifacts, runs the
oracle on the explored tasks and loads the policy.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flywheel.config import Config
    from flywheel.store import Store

# Where a trained token lies relative to the oracle's path (LOCATIONS, in the report's order).
ON_PATH, DEPARTURE, AFTER, NO_ORACLE = (
    "on the oracle's path",
    "departing token",
    "after it",
    "no oracle",
)
LOCATIONS = (ON_PATH, DEPARTURE, AFTER, NO_ORACLE)


@dataclass(frozen=True)
class Sample:
    """One explored trajectory as training sees it: its encoded ids, the trained positions'
    mask, its reward and success, and its group (env, task)."""

    group: tuple[str, str]
    ids: list[int]
    mask: list[int]
    reward: float
    success: bool


def departure(ids: Sequence[int], oracle: Sequence[int]) -> int:
    """Position of the first token where ``ids`` leaves ``oracle`` (their common prefix's
    length); ``len(ids)`` when it never does."""
    n = min(len(ids), len(oracle))
    return next((i for i in range(n) if ids[i] != oracle[i]), n)


def cut_after_departure(
    ids: Sequence[int], mask: Sequence[int], better: Sequence[Sequence[int]]
) -> list[int]:
    """``mask`` with every position after the sample's departure from ``better`` cleared: the
    first token where it leaves all of them (the longest prefix it shares with any one) is the
    last it keeps. GRPO's ``failure_credit: departure`` applies this to below-average samples,
    whose better samples are the group's samples with a higher reward."""
    if not better:
        return list(mask)
    depart = max(departure(ids, other) for other in better)
    return [m if pos <= depart else 0 for pos, m in enumerate(mask)]


def advantages(rewards: Sequence[float]) -> list[float]:
    """GRPO's group advantages (flywheel.training.losses.group_advantages, in plain floats):
    unbiased std; a group of one uses mean 0, std 1."""
    n = len(rewards)
    if n == 1:
        return [rewards[0]]
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
    return [(r - mean) / (std + 1e-6) for r in rewards]


def _location(pos: int, depart: int | None) -> str:
    if depart is None:
        return NO_ORACLE
    return ON_PATH if pos < depart else DEPARTURE if pos == depart else AFTER


@dataclass
class Credit:
    """What ``measure`` found (see the module docstring); masses are sums of |advantage| over
    trained token positions."""

    groups: int = 0
    samples: int = 0
    failed: int = 0
    failed_tokens: int = 0
    failed_tokens_on_path: int = 0
    departing_turn: dict[int, int] = field(default_factory=dict)  # 1-based assistant turn
    gross: float = 0.0
    net: float = 0.0
    # Failed samples' own (negative) weight by location, and what is left of it at those nodes
    # once the group's other samples through them are added.
    pushed_down: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LOCATIONS, 0.0))
    net_down: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LOCATIONS, 0.0))
    # (failed sample, its departure, the oracle's token there; -1 past the oracle's end)
    departures: list[tuple[Sample, int, int]] = field(default_factory=list)

    @property
    def cancelled(self) -> float:
        return 1.0 - self.net / self.gross if self.gross else 0.0


def _turn_of(mask: Sequence[int], pos: int) -> int:
    """1-based index of the trained span (assistant turn) holding position ``pos``."""
    turn, inside = 0, False
    for i in range(pos + 1):
        if mask[i] and not inside:
            turn += 1
        inside = bool(mask[i])
    return turn


def measure(samples: Iterable[Sample], oracle: dict[tuple[str, str], list[int]]) -> Credit:
    """Departures and GRPO's net weights over the groups of ``samples`` whose rewards differ.
    ``oracle`` maps a group to its oracle trajectory's encoded ids (a missing one: no oracle)."""
    by_group: dict[tuple[str, str], list[Sample]] = defaultdict(list)
    for s in samples:
        by_group[s.group].append(s)
    out = Credit()
    for key, group in by_group.items():
        if len({s.reward for s in group}) < 2:
            continue
        out.groups += 1
        out.samples += len(group)
        weights = advantages([s.reward for s in group])
        path = oracle.get(key)
        nodes: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        net: dict[int, float] = defaultdict(float)
        visits = []  # (sample, advantage, node, location) per trained position
        for s, a in zip(group, weights, strict=True):
            depart = departure(s.ids, path) if path is not None else None
            if not s.success and path is not None and depart is not None:
                out.departures.append((s, depart, path[depart] if depart < len(path) else -1))
                if depart < len(s.ids) and s.mask[depart]:
                    turn = _turn_of(s.mask, depart)
                    out.departing_turn[turn] = out.departing_turn.get(turn, 0) + 1
            node = -1
            for pos, tok in enumerate(s.ids):
                node = nodes.setdefault((node, tok), len(nodes))
                if s.mask[pos]:
                    net[node] += a
                    visits.append((s, a, node, _location(pos, depart)))
        for node_weight in net.values():
            out.net += abs(node_weight)
        seen: set[tuple[int, str]] = set()
        for s, a, node, where in visits:
            out.gross += abs(a)
            if s.success:
                continue
            out.failed_tokens += 1
            out.failed_tokens_on_path += where == ON_PATH
            out.pushed_down[where] += max(-a, 0.0)
            if (node, where) not in seen:  # a node counts once, however many failures share it
                seen.add((node, where))
                out.net_down[where] += max(-net[node], 0.0)
        out.failed += sum(not s.success for s in group)
    return out


def greedy_share(
    departures: Sequence[tuple[Sample, int, int]], first_choice: Callable[[list[int]], int]
) -> tuple[int, int]:
    """``(n, greedy)``: how many failed samples depart from the oracle on a generated token, and
    at how many of them the policy's own first choice (``first_choice(context)``, its argmax)
    leaves the oracle too: greedy decoding would make a mistake there as well. At the others the
    sample slipped where greedy decoding follows the oracle."""
    n = greedy = 0
    for s, pos, oracle_token in departures:
        if pos >= len(s.ids) or not s.mask[pos] or oracle_token < 0:
            continue
        n += 1
        greedy += first_choice(s.ids[:pos]) != oracle_token
    return n, greedy


def format_credit(c: Credit, greedy: tuple[int, int] | None = None) -> str:
    """The command's report: plain text, one fact per line."""
    pct = lambda x, total: f"{100 * x / total:.1f}%" if total else "n/a"  # noqa: E731
    lines = [
        f"groups with differing rewards: {c.groups} ({c.samples} samples, {c.failed} failed)",
        f"failed samples: {c.failed_tokens} generated tokens, "
        f"{pct(c.failed_tokens_on_path, c.failed_tokens)} of them on the oracle's path "
        "(before the departure)",
        "departing assistant turn (1st, 2nd, ...): "
        + (" / ".join(str(c.departing_turn[t]) for t in sorted(c.departing_turn)) or "none"),
        f"GRPO weight: gross {c.gross:.1f}, net {c.net:.1f}: "
        f"{100 * c.cancelled:.1f}% cancels inside the groups",
        "failed samples' negative weight by where it lands (own -> net of the group):",
    ]
    down, net = sum(c.pushed_down.values()), sum(c.net_down.values())
    for where in LOCATIONS:
        own, left = c.pushed_down[where], c.net_down[where]
        if own:
            lines.append(
                f"  {where:<21} {own:9.1f} ({pct(own, down)}) -> {left:9.1f} ({pct(left, net)})"
            )
    if greedy is not None:
        n, g = greedy
        lines.append(
            f"departures where the policy's greedy choice leaves the oracle too: {g} of {n} "
            f"({pct(g, n)}; the rest are slips of sampling)"
        )
    return "\n".join(lines)


# -- the command ----------------------------------------------------------------------------------


def _first_choice(model: Any) -> Callable[[list[int]], int]:
    import torch

    @torch.no_grad()
    def first(context: list[int]) -> int:
        logits = model(torch.tensor([context])).logits[0, -1]
        return int(logits.argmax())

    return first


def credit_report(cfg: Config, store: Store, artifact_id: str, *, greedy: bool = True) -> str:
    """``flywheel credit``: read an explore artifact, run each env's oracle on its tasks, load
    the policy that explored and measure (``measure``, ``greedy_share``); the report's text."""
    from flywheel.agent import expert_episodes
    from flywheel.checkpoint import load_policy
    from flywheel.envs import has_oracle, make_suite
    from flywheel.progress import Progress
    from flywheel.trajectory import Trajectory
    from stages._common import load_tasks

    ref = store.get(artifact_id)
    if ref.stage != "explore":
        raise ValueError(
            f"{artifact_id} is a {ref.stage} artifact; credit reads an explore artifact"
        )
    policy_id, tasks_id = ref.inputs
    rows = store.read(ref).to_pylist()
    envs = {e.name: e for e in cfg.envs}
    explored = sorted({row["env"] for row in rows})
    unknown = [env for env in explored if env not in envs]
    if unknown:  # refused before the policy loads
        raise ValueError(
            f"{artifact_id} explored env {unknown[0]!r}, which the config does not name"
        )
    model, tokenizer = load_policy(store, store.get(policy_id))
    samples = []
    for row in rows:
        ids, mask, _ = Trajectory.from_row(row).encode_sampled(tokenizer)
        samples.append(
            Sample((row["env"], row["task_id"]), ids, mask, float(row["reward"] or 0.0),
                   bool(row["success"]))
        )  # fmt: skip
    oracle: dict[tuple[str, str], list[int]] = {}
    for env in explored:
        suite = make_suite(envs[env])
        if not has_oracle(suite):
            continue  # its samples count under "no oracle"
        wanted = {row["task_id"] for row in rows if row["env"] == env}
        tasks = [t for t in load_tasks(store, store.get(tasks_id), env=env, split="train")
                 if t.task_id in wanted]  # fmt: skip
        with Progress(f"credit: {env} oracle", len(tasks), unit="episodes") as bar:
            episodes = expert_episodes(suite, tasks, progress=lambda n, _: bar.update(n - bar.done))
        for ep in episodes:
            if ep["success"]:  # an oracle that failed a task is no path to compare with
                ids, _ = Trajectory(ep["messages"]).encode(tokenizer)
                oracle[(env, ep["task_id"])] = ids
    found = measure(samples, oracle)
    share = greedy_share(found.departures, _first_choice(model)) if greedy else None
    head = f"{artifact_id}: {len(rows)} samples from {policy_id}"
    return head + "\n" + format_credit(found, share)
