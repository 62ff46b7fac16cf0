"""Reflection by hint (ALGORITHMS.md, "Reflection by hint (ET-Agent's self-evolving data
flywheel)"): failed trajectories cut after their first flawed step, a hint opening the next
assistant turn, and the policy's continuation; the continuations that succeed become revision
trajectories.

    reflections = evolve(engine, suite, [(task, row), ...], encode=tokenizer_encode,
                         sampling=SamplingParams(temperature=1.0, max_new_tokens=48),
                         max_steps=16, max_evolve_times=3, seed=0)
    rows = [r.recovered.row(suite.name) for r in reflections if r.recovered]

- **First flawed step**: the rule verifier, as splice's (``flywheel.splice.RULE_KEYS``: a step
  whose ``info`` says ``invalid``, ``error``, ``tool_error`` or ``lost_progress``). Explore rows
  keep no per-step info, so each trajectory is replayed through a fresh env
  (``flywheel.agent.replay``).
- **Cut** (``cut_point``): step hint after the first flawed step k that did not end the episode
  (steps 0..k and k's observation kept, the next assistant turn opens with the hint); with none,
  the trajectory hint (a final turn that ended the episode dropped, the hint after the last
  observation).
- **Continue**: the kept prefix is replayed into an open env (``replay(..., keep_open=True)``),
  every message of it marked not trained, and ``flywheel.agent.drive`` plays the hinted episodes
  on, all of a batch in one engine call per step; the hinted turn and what follows are trained.
  The continuation may take the env's ``max_steps`` steps after the cut.
- **Evolve**: a continuation that fails is reflected on again, from its first flawed step at or
  after the hinted one, up to ``max_evolve_times`` attempts per failed trajectory.

Hints come from the env suite (``suite.hints``, e.g. arith's "Wait, let me check the result of
that call before I go on."), whole; ``pick_hint`` chooses one by a stable hash.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from flywheel.agent import Episode, derive_seed, drive, replay
from flywheel.engines.base import Engine, SamplingParams
from flywheel.envs.base import EnvSuite, Task
from flywheel.splice import RULE_KEYS


def hints_of(envs: Sequence[Any]) -> dict[str, list[str]]:
    """Every env's reflection hints, by name (its suite's ``hints``; [] for a suite without);
    ``envs`` are ``EnvConfig``s."""
    from flywheel.envs import make_suite

    return {e.name: list(getattr(make_suite(e), "hints", ()) or ()) for e in envs}


@dataclass(frozen=True)
class Cut:
    """Where a trajectory is cut: ``keep`` env steps kept, each turn with its observation;
    ``flawed`` the index of the first flawed step (a step hint), None for a trajectory hint."""

    keep: int
    flawed: int | None = None

    @property
    def kind(self) -> str:
        return "trajectory" if self.flawed is None else "step"


def is_flawed(info: dict[str, Any]) -> bool:
    """Whether a step is flawed by the env's own signals (the rule verifier)."""
    return any(bool(info.get(key)) for key in RULE_KEYS)


def cut_point(infos: Sequence[dict[str, Any]], *, ended: bool, start: int = 0) -> Cut:
    """The cut of a trajectory whose steps gave ``infos``; ``ended``: its last step ended the
    episode (done, or an env error). The first flawed step at or after ``start`` that did not
    end the episode gets a step hint after it; else the trajectory hint: every step kept but a
    last one that ended the episode (the final answer)."""
    n = len(infos)
    for k in range(start, n):
        if is_flawed(infos[k]) and not (ended and k == n - 1):
            return Cut(keep=k + 1, flawed=k)
    return Cut(keep=n - 1 if ended and n else n)


def pick_hint(hints: Sequence[str], *key: Any) -> str:
    """One of ``hints``, chosen by a stable hash of ``key`` (task, sample, attempt)."""
    if not hints:
        raise ValueError("no hints to choose from")
    return hints[derive_seed("hint", *key) % len(hints)]


def hinted(ep: Episode, opening: list[int]) -> Episode:
    """``ep`` (a kept prefix) made ready to go on: nothing of it is trained, and its next
    assistant turn opens with the ``opening`` ids (the hint)."""
    for message in ep.messages:
        message["loss"] = False
    ep.opening = list(opening)
    return ep


@dataclass
class Reflection:
    """What became of one failed trajectory: the attempts made, the continuation that
    succeeded (None if none did), or why it was skipped (its replay gave other observations,
    or failed)."""

    task: Task
    sample_idx: int
    attempts: int = 0
    recovered: Episode | None = None
    skipped: str | None = None


def _matches(ep: Episode, row: dict[str, Any]) -> bool:
    """Whether a replay saw what the trajectory saw (a deterministic env)."""
    return [(m["role"], m["content"]) for m in ep.messages] == [
        (m["role"], m["content"]) for m in row["messages"]
    ]


def evolve(
    engine: Engine,
    suite: EnvSuite,
    failures: list[tuple[Task, dict[str, Any]]],
    *,
    encode: Callable[[str], list[int]],
    sampling: SamplingParams,
    max_steps: int,
    max_evolve_times: int = 3,
    seed: int = 0,
    env_workers: int = 8,
    progress: Callable[[int], None] | None = None,
) -> list[Reflection]:
    """Reflect on every failed trajectory (a task and its trajectory row) up to
    ``max_evolve_times`` times (module docstring); one ``Reflection`` each, in order.
    ``encode`` turns a hint into the token ids that open the hinted turn; ``progress(n)`` is
    told how many trajectories are settled (recovered, out of attempts, or skipped)."""
    hints = tuple(getattr(suite, "hints", ()) or ())
    if not hints:
        raise ValueError(f"reflect: env {suite.name} gives no hints (its suite's hints)")
    results = [Reflection(task, int(row["sample_idx"])) for task, row in failures]
    settled = 0

    def settle(n: int) -> None:
        nonlocal settled
        settled += n
        if progress is not None and n:
            progress(settled)

    with ThreadPoolExecutor(max_workers=max(1, env_workers)) as pool:

        def original(item: tuple[Task, dict[str, Any]]) -> Episode:
            task, row = item
            return replay(
                suite, task, row["messages"], row["turn_token_ids"] or [],
                row["turn_logprobs"] or [], sample_idx=int(row["sample_idx"]),
                seed=int(row["seed"]),
            )  # fmt: skip

        # (index, trajectory to reflect on, the step the search for a flaw starts at)
        live: list[tuple[int, Episode, int]] = []
        for i, ep in enumerate(pool.map(original, failures)):
            if ep.finish_reason == "error" or not _matches(ep, failures[i][1]):
                results[i].skipped = "the replay failed" if ep.ended else "the replay diverged"
            else:
                live.append((i, ep, 0))
        settle(len(failures) - len(live))

        for attempt in range(max_evolve_times):
            if not live:
                break
            cuts = [cut_point(ep.infos, ended=ep.ended, start=start) for _, ep, start in live]

            def resume(item: tuple[tuple[int, Episode, int], Cut], attempt: int = attempt):
                (i, ep, _), cut = item
                return replay(
                    suite, ep.task, ep.messages, ep.turn_token_ids, ep.turn_logprobs,
                    steps=cut.keep, keep_open=True, sample_idx=ep.sample_idx,
                    seed=derive_seed(ep.seed, "reflect", attempt),
                )  # fmt: skip

            resumed = list(pool.map(resume, zip(live, cuts, strict=True)))
            going = []
            for (i, _, _), cut, ep in zip(live, cuts, resumed, strict=True):
                if ep.ended or ep.steps != cut.keep:  # the prefix no longer replays
                    ep.close()
                    results[i].skipped = "the replay failed"
                    settle(1)
                    continue
                hint = pick_hint(hints, ep.task.task_id, ep.sample_idx, attempt)
                going.append((i, cut, hinted(ep, encode(hint))))
            episodes = [ep for _, _, ep in going]
            drive(
                engine, suite, episodes,
                sampling=replace(sampling, seed=derive_seed(seed, "attempt", attempt)),
                max_steps=max_steps, seed=derive_seed(seed, "attempt", attempt),
                env_workers=env_workers,
            )  # fmt: skip
            live = []
            for i, cut, ep in going:
                results[i].attempts += 1
                if ep.success:
                    results[i].recovered = ep
                    settle(1)
                elif attempt + 1 < max_evolve_times:
                    live.append((i, ep, cut.keep))  # the hinted step is the first to check
                else:
                    settle(1)
    return results
