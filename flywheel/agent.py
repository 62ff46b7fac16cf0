"""The agent loop: ``Episode``, the one record of an episode whatever plays it, and the driver
that runs many episodes of an environment suite at once with one engine.

With the in-process engine every step gathers the chats of all live episodes into ONE
``engine.generate`` call, then steps their environments in a thread pool (env steps may run
sandboxed subprocesses or call a server), and retires the episodes that ended. With a server
engine (one that has ``submit``) each episode instead requests its next turn the moment its env
step returns, and the server batches the requests as they come (``_drive_each``). Episodes
follow the AgentGym convention: the suite's instruction, the assistant's ``Ok.``, then the env's
first observation. Each episode becomes one trajectory row (DESIGN.md, "The central contract"),
with the generated token ids and log-probs of every assistant turn the policy produced.

    rows = run_episodes(engine, suite, tasks, samples_per_task=4,
                        sampling=SamplingParams(temperature=1.0, max_new_tokens=64), max_steps=6)
    rows = expert_episodes(suite, tasks)   # the oracle's turns replayed through real envs

An episode may also start from a prefix and be played on by the same driver: ``replay`` steps a
trajectory's turns through a fresh env (its infos recorded; with ``keep_open`` the env stays at
that point), ``Episode.resume`` takes a conversation and an env already brought to its point
(MCTS: ``snapshot()/restore()``). ``Episode.opening`` forces how the next assistant turn begins
(a reflection hint: the engine appends those ids to the prompt and generates the rest)::

    ep = replay(suite, task, row["messages"], row["turn_token_ids"], steps=2, keep_open=True)
    ep.opening = tokenizer.encode("Wait, ...", add_special_tokens=False)
    drive(engine, suite, [ep], sampling=sampling, max_steps=4)     # ep goes on from step 2
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import queue
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from flywheel.engines.base import Chat, Engine, Generation, SamplingParams
from flywheel.envs.base import Env, EnvSuite, Task
from flywheel.trajectory import Trajectory, align_turn_ids

ACK = "Ok."
_SESSIONS = itertools.count()  # a distinct engine session per episode, across calls
Outcome = tuple[str, float, bool, dict[str, Any]]  # what ``Env.step`` returns


def derive_seed(*parts: Any) -> int:
    """A stable 31-bit seed from any parts (Python's ``hash`` of a str changes per process)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def _new_session() -> int:
    return next(_SESSIONS)


@dataclass
class Turn:
    """One assistant turn: its text and, for a turn the policy generated, its token ids and
    their log-probs (forced opening ids included, with log-prob 0.0: ``Generation.forced``)."""

    text: str
    token_ids: list[int] | None = None  # None for turns the policy did not generate (expert)
    logprobs: list[float] | None = None

    @classmethod
    def generated(cls, gen: Generation) -> Turn:
        return cls(gen.text, gen.token_ids, gen.logprobs)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass
class Episode:
    """An episode's conversation, stored turn ids, counters and env, recorded the same way
    whatever plays it (the lockstep and per-episode drivers, ``replay``, the MCTS search).

    ``turn_token_ids``/``turn_logprobs`` hold the generated turns' ids, which are the last
    assistant messages (``flywheel.trajectory``). ``infos`` holds every env step's
    ``info`` (``{"error": ...}`` for a step that raised); it is not part of the row.
    ``opening``: token ids the next assistant turn must start with (the engine generates the
    rest); emptied once that turn is taken. ``session``: the engine session (None: the engine
    keeps nothing between calls)."""

    task: Task
    sample_idx: int = 0
    seed: int = 0
    messages: list[dict] = field(default_factory=list)
    env: Env | None = None
    script: list[str] = field(default_factory=list)  # expert turns still to play
    turn_token_ids: list[list[int]] = field(default_factory=list)
    turn_logprobs: list[list[float]] = field(default_factory=list)
    infos: list[dict] = field(default_factory=list)
    opening: list[int] = field(default_factory=list)
    reward: float = 0.0
    success: bool = False
    steps: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_ok: int = 0
    invalid_actions: int = 0
    finish_reason: str | None = None
    session: int | None = field(default_factory=_new_session)

    @classmethod
    def resume(
        cls,
        task: Task,
        messages: Sequence[dict],
        turn_token_ids: Sequence[Sequence[int]] = (),
        turn_logprobs: Sequence[Sequence[float]] = (),
        *,
        env: Env | None = None,
        **fields: Any,
    ) -> Episode:
        """An episode that goes on from a prefix: ``messages`` so far, the stored ids of its
        generated turns, and ``env`` already brought to that point (restored from a snapshot,
        or replayed). ``fields`` sets the rest (``session=None``, ``sample_idx``, ...)."""
        return cls(
            task=task,
            messages=[dict(m) for m in messages],
            env=env,
            turn_token_ids=[list(t) for t in turn_token_ids],
            turn_logprobs=[list(lp) for lp in turn_logprobs],
            **fields,
        )

    @property
    def ended(self) -> bool:
        """Whether the env ended the episode (done, or an env error): it cannot go on."""
        return self.finish_reason in ("done", "error")

    def trajectory(self) -> Trajectory:
        return Trajectory(self.messages, self.turn_token_ids, self.turn_logprobs)

    def chat(self) -> Chat:
        return self.trajectory().chat(session=self.session, opening=list(self.opening))

    def say(self, role: str, content: str, loss: bool = False) -> None:
        self.messages.append({"role": role, "content": content, "loss": loss})

    def open(
        self, suite: EnvSuite, *, env: Env | None = None, expert: bool = False
    ) -> BaseException | None:
        """Make (unless given) and reset the env; the failure, if any (safe in a worker
        thread). The conversation opens with the suite's instruction, ``Ok.`` and the first
        observation, or with the messages of an env that writes its own opening
        (``reset_messages``: a workflow's first model call). ``expert``: also fetch the
        oracle's turns into ``script``."""
        try:
            self.env = env if env is not None else suite.make()
            if expert:
                self.script = list(suite.expert(self.task))
            opening = getattr(self.env, "reset_messages", None)
            if opening is not None:
                for message in opening(self.task):
                    self.say(message["role"], message["content"])
                return None
            self.say("user", suite.instruction)
            self.say("assistant", ACK)
            self.say("user", self.env.reset(self.task))
        except Exception as exc:  # one broken episode must not stop the others
            if not self.messages:
                self.say("user", suite.instruction)
            return exc
        return None

    def fail(self, exc: BaseException) -> None:
        """The env failed: its error is the last observation, and the episode ends."""
        self.say("user", _error_text(exc))
        self.finish_reason = "error"

    def take(self, turn: Turn) -> None:
        """Record the assistant's turn (trained: ``loss`` true)."""
        self.say("assistant", turn.text, loss=True)
        if turn.token_ids is not None:
            self.turn_token_ids.append(list(turn.token_ids))
            self.turn_logprobs.append(list(turn.logprobs or []))
        self.opening = []

    def step(self) -> Outcome | Exception:
        """Step the env with the last turn (safe in a worker thread); its error, if it raised."""
        try:
            return self.env.step(self.messages[-1]["content"])  # type: ignore[union-attr]
        except Exception as exc:
            return exc

    def observe(self, outcome: Outcome | BaseException) -> bool:
        """Record the env's answer to the last turn; whether the episode goes on. An error or
        ``done`` ends it (``finish_reason``); a finished episode's last observation is not a
        turn."""
        self.steps += 1
        if isinstance(outcome, BaseException):
            self.infos.append({"error": _error_text(outcome)})
            self.fail(outcome)
            return False
        observation, reward, done, info = outcome
        info = dict(info or {})
        self.infos.append(info)
        self.tool_calls += bool(info.get("tool_call"))
        self.tool_errors += bool(info.get("tool_error"))
        self.tool_ok += bool(info.get("tool_ok"))
        self.invalid_actions += bool(info.get("invalid"))
        if done:
            self.reward = float(reward)
            self.success = bool(info.get("success", False))
            self.finish_reason = "done"
            return False
        self.say("user", observation)
        return True

    def close(self) -> None:
        env, self.env = self.env, None  # once: an episode may close early, and again at the end
        if env is not None:
            # Best effort: the episode's row is complete, and the other envs must still close.
            with contextlib.suppress(Exception):
                env.close()

    def row(self, env_name: str) -> dict:
        """The episode as a ``trajectories`` contract row."""
        fields = {
            "task_id": self.task.task_id,
            "env": env_name,
            "split": self.task.split,
            "sample_idx": self.sample_idx,
            "reward": float(self.reward),
            "success": bool(self.success),
            "steps": self.steps,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "tool_ok": self.tool_ok,
            "invalid_actions": self.invalid_actions,
            "tokens": sum(len(t) for t in self.turn_token_ids),
            "finish_reason": self.finish_reason,
            "seed": self.seed,
        }
        return Trajectory(self.messages, self.turn_token_ids, self.turn_logprobs, fields).to_row()


class _Lifecycle:
    """What the drivers add to an episode's own records: opening it (unless it is already at
    its point), counting it finished, and the progress callback."""

    def __init__(
        self,
        suite: EnvSuite,
        total: int,
        progress: Callable[[int, int], None] | None,
        expert: bool = False,
    ) -> None:
        self.suite, self.total, self.progress, self.expert = suite, total, progress, expert
        self.finished = 0

    def retire(self, ep: Episode, reason: str | None = None) -> None:
        if reason is not None:
            ep.finish_reason = reason
        self.finished += 1
        if self.progress is not None:
            self.progress(self.finished, self.total)

    def open(self, ep: Episode) -> BaseException | None:
        """Make and reset the env of an episode not yet open (in a worker thread)."""
        if ep.env is not None:  # resumed or replayed: already at its point
            return None
        return ep.open(self.suite, expert=self.expert)

    def opened(self, ep: Episode, failure: BaseException | None) -> bool:
        """Record how ``open`` went; whether the episode is live."""
        if failure is None:
            return True
        ep.fail(failure)
        self.retire(ep)
        return False

    def turn(self, ep: Episode, turn: Turn | None) -> bool:
        """Record the assistant's turn; whether there is an action to step."""
        if turn is None:
            self.retire(ep, "max_steps")  # nothing left to play (an expert's script ran out)
            return False
        ep.take(turn)
        return True

    def stepped(self, ep: Episode, outcome: Outcome | BaseException) -> bool:
        """Record the env's answer; whether the episode goes on."""
        if ep.observe(outcome):
            return True
        self.retire(ep)
        return False


def _step(ep: Episode) -> Outcome | Exception:
    return ep.step()


def _close(ep: Episode) -> None:
    ep.close()


def _drive(
    suite: EnvSuite,
    episodes: list[Episode],
    act: Callable[[list[Episode], int], list[Turn | None]],
    *,
    max_steps: int | None,
    env_workers: int,
    progress: Callable[[int, int], None] | None,
    expert: bool = False,
) -> list[Episode]:
    """Lockstep: open every episode, then alternate ``act`` (one batch for all live episodes)
    and env steps until each episode is done, fails, has taken ``max_steps`` more steps, or
    ``act`` has no turn for it. A suite whose envs can hold only so many episodes open at once
    (``max_open_episodes``, e.g. AgentGym servers) runs in waves of that many."""
    life = _Lifecycle(suite, len(episodes), progress, expert)
    wave = _open_limit(suite) or len(episodes) or 1
    with ThreadPoolExecutor(max_workers=max(1, env_workers)) as pool:
        for first in range(0, len(episodes), wave):
            group = episodes[first : first + wave]
            try:
                opened = pool.map(life.open, group)
                live = [ep for ep, f in zip(group, opened, strict=True) if life.opened(ep, f)]
                step_idx = 0
                while live and (max_steps is None or step_idx < max_steps):
                    turns = act(live, step_idx)
                    acting = [ep for ep, t in zip(live, turns, strict=True) if life.turn(ep, t)]
                    outcomes = pool.map(_step, acting)
                    live = [
                        ep for ep, o in zip(acting, outcomes, strict=True) if life.stepped(ep, o)
                    ]
                    step_idx += 1
                for ep in live:
                    life.retire(ep, "max_steps")
            finally:
                list(pool.map(_close, group))
    return episodes


def _open_limit(suite: EnvSuite) -> int | None:
    """How many episodes the suite's envs can hold open at once (None: no limit)."""
    limit = getattr(suite, "max_open_episodes", None)
    return int(limit) if limit else None


def _drive_each(
    suite: EnvSuite,
    episodes: list[Episode],
    submit: Callable[[Episode, int], Future[Generation]],
    *,
    max_steps: int,
    env_workers: int,
    progress: Callable[[int, int], None] | None,
) -> list[Episode]:
    """Per episode: each one asks for its next turn as soon as its env step returns, so a
    server engine batches continuously instead of idling until the slowest env step of a
    lockstep batch ends. Episode state changes only on this thread: the engine's futures and
    the env pool's post what finished to ``events``. A generation that fails for good (the
    engine already retried) stops the call; the finished envs are closed either way."""
    life = _Lifecycle(suite, len(episodes), progress)
    events: queue.Queue[tuple[str, Episode, Future[Any]]] = queue.Queue()
    limits = {id(ep): ep.steps + max_steps for ep in episodes}  # resumed ones go on from theirs
    pending = 0

    def post(kind: str, ep: Episode, future: Future[Any]) -> None:
        nonlocal pending
        pending += 1
        future.add_done_callback(lambda f: events.put((kind, ep, f)))

    waiting = list(reversed(episodes))  # not opened yet; at most _open_limit() open at once
    limit = _open_limit(suite) or len(episodes)
    with ThreadPoolExecutor(max_workers=max(1, env_workers)) as pool:

        def open_next() -> None:
            if waiting:
                ep = waiting.pop()
                post("opened", ep, pool.submit(life.open, ep))

        def finished(ep: Episode) -> None:
            """The episode ended: close its env now (a server slot frees) and open the next."""
            post("closed", ep, pool.submit(_close, ep))
            open_next()

        try:
            for _ in range(min(limit, len(episodes))):
                open_next()
            while pending:
                kind, ep, future = events.get()
                pending -= 1
                if kind == "closed":
                    continue
                if kind == "opened":
                    goes_on = life.opened(ep, future.result())
                elif kind == "generated":
                    gen = future.result()  # raises the engine's error: the call stops
                    life.turn(ep, Turn.generated(gen))
                    post("stepped", ep, pool.submit(_step, ep))
                    continue
                else:
                    goes_on = life.stepped(ep, future.result())
                if goes_on and ep.steps >= limits[id(ep)]:
                    life.retire(ep, "max_steps")
                    goes_on = False
                if goes_on:
                    post("generated", ep, submit(ep, ep.steps))
                else:
                    finished(ep)
        finally:
            # Let what is in flight end before the envs close under it.
            while pending:
                events.get()
                pending -= 1
            list(pool.map(_close, episodes))
    return episodes


def drive(
    engine: Engine,
    suite: EnvSuite,
    episodes: list[Episode],
    *,
    sampling: SamplingParams,
    max_steps: int,
    seed: int = 0,
    env_workers: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> list[Episode]:
    """Play every episode on with the policy behind ``engine``: open the ones not open yet
    (env made and reset; a resumed or replayed episode is already at its point), then turn by
    turn until each is done, fails, or has taken ``max_steps`` more steps; every env is closed
    at the end. Returns ``episodes``. Deterministic for a given ``seed`` when the engine is
    (each step's sampling seed is derived from it)."""
    done = next((ep for ep in episodes if ep.finish_reason is not None), None)
    if done is not None:
        raise ValueError(
            f"drive: an episode of {done.task.task_id} already finished ({done.finish_reason})"
        )
    submit_one = getattr(engine, "submit", None)
    if submit_one is not None:  # a server engine: episodes do not wait for each other

        def submit(ep: Episode, step_idx: int) -> Future[Generation]:
            return submit_one(ep.chat(), replace(sampling, seed=derive_seed(ep.seed, step_idx)))

        return _drive_each(
            suite, episodes, submit, max_steps=max_steps, env_workers=env_workers,
            progress=progress,
        )  # fmt: skip

    def act(live: list[Episode], step_idx: int) -> list[Turn | None]:
        params = replace(sampling, seed=derive_seed(seed, sampling.seed, "step", step_idx))
        generations = engine.generate([ep.chat() for ep in live], params)
        return [Turn.generated(g) for g in generations]

    return _drive(
        suite, episodes, act, max_steps=max_steps, env_workers=env_workers, progress=progress
    )


def run_episodes(
    engine: Engine,
    suite: EnvSuite,
    tasks: list[Task],
    *,
    samples_per_task: int = 1,
    sampling: SamplingParams,
    max_steps: int,
    seed: int = 0,
    env_workers: int = 8,
    progress: Callable[[int, int], None] | None = None,
    with_infos: bool = False,
) -> list[dict]:
    """Run ``samples_per_task`` episodes of every task with the policy behind ``engine``; one
    trajectory row per episode, in task order then sample order (``drive``). ``with_infos``:
    each row also holds ``infos``, the ``info`` of every step as played (not a contract
    column: a caller takes what it needs from it)."""
    episodes = [
        Episode(task=task, sample_idx=k, seed=derive_seed(seed, task.task_id, k))
        for task in tasks
        for k in range(samples_per_task)
    ]
    drive(
        engine, suite, episodes, sampling=sampling, max_steps=max_steps, seed=seed,
        env_workers=env_workers, progress=progress,
    )  # fmt: skip
    if with_infos:
        return [{**ep.row(suite.name), "infos": ep.infos} for ep in episodes]
    return [ep.row(suite.name) for ep in episodes]


def expert_episodes(
    suite: EnvSuite,
    tasks: list[Task],
    *,
    env_workers: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> list[dict]:
    """Replay ``suite.expert(task)`` through real envs: rows shaped like ``run_episodes``'s, with
    no token ids or log-probs. An episode whose script ends before the env says done finishes
    as ``max_steps``."""
    episodes = [
        Episode(task=task, sample_idx=0, seed=derive_seed(0, task.task_id, 0)) for task in tasks
    ]

    def act(live: list[Episode], step_idx: int) -> list[Turn | None]:
        return [Turn(ep.script[step_idx]) if step_idx < len(ep.script) else None for ep in live]

    _drive(
        suite,
        episodes,
        act,
        max_steps=None,
        env_workers=env_workers,
        progress=progress,
        expert=True,
    )
    return [ep.row(suite.name) for ep in episodes]


def replay(
    suite: EnvSuite,
    task: Task,
    messages: Sequence[dict],
    turn_token_ids: Sequence[Sequence[int]] = (),
    turn_logprobs: Sequence[Sequence[float]] = (),
    *,
    steps: int | None = None,
    keep_open: bool = False,
    **fields: Any,
) -> Episode:
    """A trajectory played again through a fresh env: the episode opens as the agent loop
    opens it, then every assistant turn after the opening is taken (with its stored ids) and
    stepped, recorded as the agent loop records it, until ``steps`` steps (all: None) or the
    env ends it. Its messages hold the replayed observations and ``infos`` every step's info.
    With ``keep_open`` the env stays open at that point, for ``drive`` to play on (close it
    otherwise); ``fields`` as in ``Episode.resume``. Exact for deterministic envs."""
    ep = Episode(task=task, **fields)
    failure = ep.open(suite)
    if failure is not None:
        ep.fail(failure)
        ep.close()
        return ep
    ids = align_turn_ids(messages, turn_token_ids)
    logprobs = align_turn_ids(messages, turn_logprobs)
    turns = [
        Turn(m["content"], ids[i] or None, logprobs[i] if ids[i] else None)
        for i, m in enumerate(m for m in messages if m["role"] == "assistant")
    ]
    opened = sum(m["role"] == "assistant" for m in ep.messages)  # ``Ok.``: not an action
    try:
        for turn in turns[opened:]:
            if steps is not None and ep.steps >= steps:
                break
            ep.take(turn)
            if not ep.observe(ep.step()):
                break
    finally:
        if not keep_open or ep.ended:
            ep.close()
    return ep
