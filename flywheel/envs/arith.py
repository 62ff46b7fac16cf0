"""``arith``: tool-integrated math word problems, generated procedurally (no download).

A task is a short story about one person's apples, boxes or coins, changed by 1-3 arithmetic
steps (the difficulty), with distractor sentences carrying irrelevant numbers. The agent calls
a sandboxed Python tool and answers::

    suite = ArithSuite()
    task = suite.tasks("train", n=1, seed=0)[0]
    env = suite.make()
    obs = env.reset(task)                       # the story and its question
    obs, reward, done, info = env.step("<python>print(37 + 12)</python>")   # obs == "49"
    obs, reward, done, info = env.step("<answer>49</answer>")               # reward 1.0 if right
    env.close()

Every operand, intermediate and answer is an integer in 0..999 (one token each for the embedded
tokenizer with ``model.tiny.number_digits: 3``, a token per digit with 1, the default config's)
and the vocabulary stays at a few hundred words, so a tiny word-level policy can read it.
Prompts are split by a hash of their text, so train, val and test never share a prompt.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from flywheel.envs.base import Task
from flywheel.envs.sandbox import run_python

NAMES = (
    "Sam", "Ann", "Tom", "Mia", "Ben", "Lily", "Max", "Emma", "Leo", "Zoe",
    "Jack", "Nora", "Omar", "Lucy", "Ravi", "Kim", "Alex", "Eva", "Finn", "Ivy",
)  # fmt: skip
ITEMS = (
    ("apple", "apples"), ("pear", "pears"), ("orange", "oranges"), ("egg", "eggs"),
    ("cookie", "cookies"), ("pencil", "pencils"), ("book", "books"), ("card", "cards"),
    ("stamp", "stamps"), ("marble", "marbles"), ("shell", "shells"), ("sticker", "stickers"),
    ("candy", "candies"), ("flower", "flowers"), ("cup", "cups"), ("rock", "rocks"),
    ("toy", "toys"), ("plum", "plums"), ("lemon", "lemons"), ("button", "buttons"),
)  # fmt: skip
BOXES = (
    ("box", "boxes"), ("bag", "bags"), ("basket", "baskets"), ("crate", "crates"),
    ("jar", "jars"), ("pack", "packs"),
)  # fmt: skip
PLACES = ("garden", "room", "shop", "kitchen", "class", "park", "school", "house")
THINGS = ("hat", "ticket", "kite", "lamp", "ball", "game", "map", "bike")

# Story sentences per (state, op). {n} is the step's number, the rest are names and nouns.
START = {
    "items": (
        "{name} has {n} {items}.",
        "{name} starts with {n} {items}.",
        "There are {n} {items} in {name}'s {place}.",
    ),
    "boxes": ("{name} has {n} {boxes} of {items}.", "{name} buys {n} {boxes} of {items}."),
    "coins": ("{name} has {n} coins.", "{name} saves {n} coins.", "{name} starts with {n} coins."),
}
STEPS = {
    ("items", "+"): (
        "{friend} gives {name} {n} more {items}.",
        "Then {name} buys {n} more {items}.",
        "{name} finds {n} more {items}.",
        "Later, {name} gets {n} {items} from {friend}.",
    ),
    ("items", "-"): (
        "{name} gives {n} {items} to {friend}.",
        "Then {name} sells {n} of the {items}.",
        "{name} loses {n} {items}.",
        "{friend} takes {n} of the {items}.",
    ),
    ("items", "*"): (
        "A week later, {name} has {n} times as many {items}.",
        "Then {name} ends up with {n} times as many {items}.",
    ),
    ("sell", "*"): (
        "{name} sells all the {items} for {n} coins each.",
        "{name} sells every {item} for {n} coins.",
        "Each {item} sells for {n} coins, and {name} sells all of them.",
    ),
    ("pack", "/"): (
        "{name} packs the {items} into {boxes} of {n}.",
        "{name} puts the {items} into {boxes}, {n} in each {box}.",
        "{name} fills {boxes} with the {items}, {n} {items} per {box}.",
    ),
    ("boxes", "+"): (
        "{friend} gives {name} {n} more {boxes} of {items}.",
        "Then {name} buys {n} more {boxes} of {items}.",
    ),
    ("boxes", "-"): (
        "{name} gives {n} {boxes} to {friend}.",
        "Then {name} sells {n} of the {boxes}.",
    ),
    ("unpack", "*"): (
        "Each {box} holds {n} {items}.",
        "There are {n} {items} in every {box}.",
        "Every {box} has {n} {items} in it.",
    ),
    ("coins", "+"): (
        "{friend} pays {name} {n} more coins.",
        "{name} earns {n} more coins.",
        "Then {name} finds {n} coins.",
    ),
    ("coins", "-"): (
        "{name} spends {n} coins on a {thing}.",
        "{name} pays {n} coins for a {thing}.",
        "{name} gives {n} coins to {friend}.",
    ),
    ("buy", "/"): (
        "{name} spends all the coins on {items} that cost {n} coins each.",
        "With all the coins, {name} buys {items} at {n} coins each.",
    ),
}
QUESTIONS = {
    "items": (
        "How many {items} does {name} have now?",
        "How many {items} does {name} have in the end?",
    ),
    "boxes": (
        "How many {boxes} does {name} have now?",
        "How many {boxes} does {name} have in the end?",
    ),
    "coins": (
        "How many coins does {name} have now?",
        "How many coins does {name} have in the end?",
    ),
}
DISTRACTORS = (
    "{other} has {d} {other_items}.",
    "{name} is {d} years old.",
    "{other} lives {d} steps from the {place}.",
    "The {place} has {d} chairs.",
    "{other} reads {d} pages of a book.",
    "There are {d} {other_items} in the {place}.",
)
# (kind, op, new kind, template key); a step is only drawn when its operand can keep every
# value an integer in 0..999.
TRANSITIONS = (
    ("items", "+", "items", "items"),
    ("items", "-", "items", "items"),
    ("items", "*", "items", "items"),
    ("items", "*", "coins", "sell"),
    ("items", "/", "boxes", "pack"),
    ("boxes", "+", "boxes", "boxes"),
    ("boxes", "-", "boxes", "boxes"),
    ("boxes", "*", "items", "unpack"),
    ("coins", "+", "coins", "coins"),
    ("coins", "-", "coins", "coins"),
    ("coins", "/", "items", "buy"),
)
START_RANGES = {"items": (5, 300), "boxes": (2, 40), "coins": (10, 500)}
MAX_VALUE = 999
# hash bucket (of 4) of a prompt's text -> the only split that may use it
SPLIT_BUCKETS = {"test": (0,), "val": (1,), "train": (2, 3)}
PY_SYMBOL = {"+": "+", "-": "-", "*": "*", "/": "//"}

INSTRUCTION = (
    "Solve the math word problem. You can run Python: write <python>print(...)</python> and "
    "its output comes back to you. Compute one step at a time. When you know the result, "
    "reply with <answer>NUMBER</answer>."
)
INVALID = (
    "Invalid action. Use <python>print(...)</python> to compute or <answer>NUMBER</answer> "
    "to answer."
)
# Reflection hints (ALGORITHMS.md, "Reflection by hint"): the opening of an assistant turn
# after a flawed step; the policy writes the rest of the turn (its tool call or answer).
HINTS = ("Wait, let me check the result of that call before I go on.\n",)
# The action a splice revision turn takes (ALGORITHMS.md, "Revision splicing"): a tool call that
# prints nothing. Tool calls keep no state, so it changes nothing; the env answers "(no output)".
NOOP = "<python>print()</python>"


def split_of(prompt: str) -> str:
    """The split a prompt belongs to; the generator only keeps prompts of the requested split."""
    bucket = hashlib.sha256(prompt.encode()).digest()[0] % 4
    return next(split for split, buckets in SPLIT_BUCKETS.items() if bucket in buckets)


def _feasible(op: str, value: int, max_value: int = MAX_VALUE) -> bool:
    """Whether some operand keeps ``value op n`` an integer in range (n >= 2, n >= 1 for -)."""
    if op == "+":
        return value <= max_value - 2
    if op == "-":
        return value >= 2
    if op == "*":
        return 0 < value <= max_value // 2
    return any(value % n == 0 and value // n >= 2 for n in range(2, 13))


def _operand(op: str, value: int, rng: random.Random, max_value: int = MAX_VALUE) -> int:
    """A number for ``value op n`` that keeps the result an integer in range (op feasible)."""
    if op == "+":
        return rng.randint(2, min(max(2, max_value * 3 // 20), max_value - value))
    if op == "-":
        return rng.randint(1, value - 1)
    if op == "*":
        return rng.randint(2, min(12, max_value // value))
    return rng.choice([n for n in range(2, 13) if value % n == 0 and value // n >= 2])


class _Retry(Exception):
    """The draw painted itself into a corner; the caller draws again with the next stream."""


def _draw(
    rng: random.Random, difficulty: int, max_distractors: int, max_value: int = MAX_VALUE
) -> tuple[str, list[dict[str, Any]]]:
    """One story with ``difficulty`` steps; returns the prompt and the steps (op, a, b, result)."""
    name, friend, other = rng.sample(NAMES, 3)
    item_pool = list(ITEMS)
    rng.shuffle(item_pool)
    words = {
        "name": name,
        "friend": friend,
        "place": rng.choice(PLACES),
        "thing": rng.choice(THINGS),
    }
    words["item"], words["items"] = item_pool.pop()
    words["box"], words["boxes"] = rng.choice(BOXES)
    kind = rng.choice(("items", "items", "boxes", "coins"))
    lo, hi = START_RANGES[kind]
    value = rng.randint(lo, max(lo, min(hi, max_value // 2)))
    sentences = [rng.choice(START[kind]).format(n=value, **words)]
    steps: list[dict[str, Any]] = []
    packed = False  # once packed, the box size is known: no "each box holds n" after
    while len(steps) < difficulty:
        options = [
            t
            for t in TRANSITIONS
            if t[0] == kind
            and _feasible(t[1], value, max_value)
            and not (packed and t[3] == "unpack")
        ]
        if not options:
            raise _Retry
        op = rng.choice(sorted({t[1] for t in options}))  # ops equally likely, then wordings
        _, op, new_kind, key = rng.choice([t for t in options if t[1] == op])
        n = _operand(op, value, rng, max_value)
        if key == "buy":  # coins are spent on a new kind of item
            words["item"], words["items"] = item_pool.pop()
        if key == "pack":
            words["box"], words["boxes"] = rng.choice(BOXES)
        sentences.append(rng.choice(STEPS[(key, op)]).format(n=n, **words))
        result = {"+": value + n, "-": value - n, "*": value * n, "/": value // n}[op]
        steps.append({"op": op, "a": value, "b": n, "result": result})
        kind, value, packed = new_kind, result, packed or key == "pack"
    other_items = item_pool.pop()[1]
    for _ in range(rng.randint(0, max_distractors)):
        template = rng.choice(DISTRACTORS)
        sentence = template.format(
            d=rng.randint(2, min(90, max_value)), other=other, other_items=other_items, **words
        )
        sentences.insert(rng.randint(1, len(sentences)), sentence)
    sentences.append(rng.choice(QUESTIONS[kind]).format(**words))
    return " ".join(sentences), steps


class ArithOptions(BaseModel):
    """The options of ``envs.<name>.options`` for arith, checked before any work starts."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    difficulty_weights: tuple[float, float, float] = Field(
        default=(1.0, 1.0, 1.0), description="Relative frequency of difficulty 1, 2 and 3."
    )
    max_distractors: int = Field(default=2, ge=0, description="Distractor sentences at most.")
    max_value: int = Field(
        default=MAX_VALUE, ge=50, le=MAX_VALUE, description="Largest number in a task."
    )
    timeout_s: float = Field(
        default=2.0, gt=0, le=3600, description="Wall-clock seconds per tool call."
    )
    cpu_s: int = Field(default=1, ge=1, le=3600, description="CPU seconds per tool call.")
    memory_mb: int = Field(
        default=256, ge=32, le=1 << 20, description="Address space of a tool call, in MiB."
    )
    max_output_chars: int = Field(
        default=500, ge=1, description="Tool output kept for the observation."
    )

    @field_validator("difficulty_weights")
    @classmethod
    def _weights(cls, weights: tuple[float, float, float]) -> tuple[float, float, float]:
        if min(weights) < 0 or not sum(weights):
            raise ValueError(f"needs 3 weights >= 0, not all 0, got {list(weights)}")
        return weights


class ArithSuite:
    """Task generator, oracle and episode factory of the ``arith`` environment.

    ``difficulty_weights``: relative frequency of difficulty 1, 2, 3 (number of steps).
    ``max_distractors``: each prompt gets 0..this many sentences with irrelevant numbers.
    ``max_value``: every operand, intermediate and answer stays in 0..max_value. Small ranges
    make each number token frequent, which a tiny policy needs to learn to copy numbers.
    The remaining arguments are the sandbox limits of the episodes' Python tool.
    """

    name = "arith"
    instruction = INSTRUCTION
    hints = HINTS  # how a reflection turn opens (stage reflect)
    noop = NOOP  # the action a revision turn takes (stage splice): it changes nothing
    Options = ArithOptions  # make_suite checks envs.<name>.options against it

    def __init__(
        self,
        difficulty_weights: Sequence[float] = (1.0, 1.0, 1.0),
        max_distractors: int = 2,
        max_value: int = MAX_VALUE,
        timeout_s: float = 2.0,
        cpu_s: int = 1,
        memory_mb: int = 256,
        max_output_chars: int = 500,
    ) -> None:
        opts = ArithOptions(
            difficulty_weights=tuple(difficulty_weights),  # type: ignore[arg-type]
            max_distractors=max_distractors,
            max_value=max_value,
            timeout_s=timeout_s,
            cpu_s=cpu_s,
            memory_mb=memory_mb,
            max_output_chars=max_output_chars,
        )  # a pydantic ValidationError (a ValueError) names the bad argument
        self.difficulty_weights = opts.difficulty_weights
        self.max_distractors = opts.max_distractors
        self.max_value = opts.max_value
        self.limits: dict[str, Any] = opts.model_dump(
            include={"timeout_s", "cpu_s", "memory_mb", "max_output_chars"}
        )

    def tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """``n`` distinct tasks of ``split`` (train, val or test); a prefix of a longer call."""
        if split not in SPLIT_BUCKETS:
            raise ValueError(f"unknown split {split!r}; expected one of {sorted(SPLIT_BUCKETS)}")
        tasks: list[Task] = []
        seen: set[str] = set()
        draw = 0
        while len(tasks) < n:
            # one stream per draw: a task does not depend on n, and splits never share streams
            rng = random.Random(f"arith/{split}/{seed}/{draw}")
            draw += 1
            difficulty = rng.choices((1, 2, 3), weights=self.difficulty_weights)[0]
            try:
                prompt, steps = _draw(rng, difficulty, self.max_distractors, self.max_value)
            except _Retry:
                continue
            if prompt in seen or split_of(prompt) != split:
                continue
            seen.add(prompt)
            tasks.append(
                Task(
                    task_id=f"{self.name}-{split}-{len(tasks):06d}",
                    env=self.name,
                    split=split,
                    seed=seed,
                    difficulty=difficulty,
                    prompt=prompt,
                    answer=str(steps[-1]["result"]),
                    meta={"steps": steps, "draw": draw - 1},
                )
            )
        return tasks

    def expert(self, task: Task) -> list[str]:
        """One tool call per step, each on the previous result, then the answer."""
        turns = [
            f"<python>print({s['a']} {PY_SYMBOL[s['op']]} {s['b']})</python>"
            for s in task.meta["steps"]
        ]
        return [*turns, f"<answer>{task.answer}</answer>"]

    def make(self) -> ArithEnv:
        return ArithEnv(**self.limits)


_CLOSED_TAG = re.compile(r"<(python|answer)>(.*?)</\1>", re.DOTALL)
# An engine that stops on "</python>" may strip the stop string: accept a trailing open tag.
_OPEN_TAG = re.compile(r"<(python|answer)>((?:(?!<(?:python|answer)>).)*)\Z", re.DOTALL)
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d*)?")


def parse_action(action: str) -> tuple[str, str] | None:
    """The last ``<python>`` or ``<answer>`` tag as (tag, content), or None."""
    closed = list(_CLOSED_TAG.finditer(action))
    tail_start = closed[-1].end() if closed else 0
    tail = _OPEN_TAG.search(action, tail_start)
    match = tail or (closed[-1] if closed else None)
    if match is None or not match.group(2).strip():
        return None
    return match.group(1), match.group(2).strip()


def answer_matches(text: str, gold: str) -> bool:
    """Numeric comparison that tolerates "147.0", a sign and surrounding spaces."""
    text = text.strip()
    if not _NUMBER.fullmatch(text):
        return False
    try:
        return abs(float(text) - float(gold)) < 1e-6
    except ValueError:
        return False


class ArithEnv:
    """One ``arith`` episode at a time; Python actions run in ``flywheel.envs.sandbox``."""

    def __init__(
        self,
        timeout_s: float = 2.0,
        cpu_s: int = 1,
        memory_mb: int = 256,
        file_size_mb: int = 1,
        max_output_chars: int = 500,
    ) -> None:
        self.limits: dict[str, Any] = {
            "timeout_s": timeout_s,
            "cpu_s": cpu_s,
            "memory_mb": memory_mb,
            "file_size_mb": file_size_mb,
            "max_output_chars": max_output_chars,
        }
        self._task: Task | None = None
        self._done = False

    def reset(self, task: Task) -> str:
        self._task, self._done = task, False
        return task.prompt

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self._task is None:
            raise RuntimeError("ArithEnv.step() before reset()")
        if self._done:
            raise RuntimeError(f"episode {self._task.task_id} is done; call reset() first")
        info = {"tool_call": False, "tool_error": False, "tool_ok": False, "invalid": False}
        info["success"] = False
        parsed = parse_action(action)
        if parsed is None:
            info["invalid"] = True
            return INVALID, 0.0, False, info
        tag, content = parsed
        if tag == "answer":
            self._done = True
            info["success"] = answer_matches(content, self._task.answer)
            return "Done.", float(info["success"]), True, info
        result = run_python(content, **self.limits)
        output = result.output.strip()
        info["tool_call"] = True
        info["tool_error"] = result.status != "ok"
        info["tool_ok"] = result.status == "ok" and bool(output)
        if result.status != "ok":
            observation = (output + "\n" if output else "") + f"Error: {result.error}"
        else:
            observation = (output or "(no output)") + (" ..." if result.truncated else "")
        return observation, 0.0, False, info

    def snapshot(self) -> dict[str, Any]:
        """The episode state; tool calls keep none, so restoring needs no replay."""
        return {"task": self._task, "done": self._done}

    def restore(self, state: dict[str, Any]) -> None:
        self._task, self._done = state["task"], state["done"]

    def close(self) -> None:
        # Each tool call's process and directory are gone when it returns; nothing is held.
        self._task, self._done = None, False
