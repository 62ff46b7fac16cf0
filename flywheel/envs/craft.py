"""``craft``: a TextCraft-style crafting world, generated procedurally per task (no download).

Each task is a small world: base items the agent takes with ``get``, recipes that make one item
from exact ingredients, and a goal item whose recipe tree is 1 to 4 crafts deep (the
difficulty). The prompt lists the goal's recipes mixed with distractor recipes the goal does not
need, some of which eat the goal's ingredients::

    suite = CraftSuite()
    task = suite.tasks("train", n=1, seed=0)[0]
    env = suite.make()
    obs = env.reset(task)       # "Crafting commands:\\ncraft oak stick using 2 oak log\\n...Goal: ..."
    obs, reward, done, info = env.step("get 2 oak log")                     # "Got 2 oak log."
    obs, reward, done, info = env.step("craft oak stick using 2 oak log")   # "Crafted 1 oak stick."
    state = env.snapshot()      # branch here; env.restore(state) comes back (MCTS)

Actions (the first non-empty line after a turn's last ``Action:``, or of the whole turn;
lowercased, a trailing period ignored): ``get N ITEM`` (or ``get ITEM`` for one),
``craft ITEM using N ITEM, N ITEM`` and ``inventory`` (changes nothing: the no-op of a revision
turn). Reward 1 when the goal is crafted (done); the agent loop cuts the episode at max steps.

``info`` on every step: ``tool_call``/``tool_ok``/``tool_error`` are always false (the world's
actions are moves, not tool calls: efficiency metrics count steps here); ``invalid`` (the action
did not parse); ``error`` with ``error_kind`` (a parsed action that failed, ERROR_KINDS);
``progress`` (units of the goal's plan done: crafts and base items, held and not yet used, that
the goal still needs, out of ``progress_total``); ``lost_progress`` (this action lowered
progress: a craft ate an item the goal needed); ``action`` (the parsed action in canonical
form, "" when invalid); ``success``.

Item names are two words from small lists ("iron ore", "oak stick") and every number is at most
``max_get`` (10), so a tiny word-level policy can read every prompt. Tasks are split by a hash
of the goal's recipe tree, so train, val and test never share a goal tree.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from flywheel.envs.base import Task

MATERIALS = (
    "oak", "pine", "iron", "gold", "stone", "clay",
    "wool", "sand", "copper", "silver", "red", "blue",
)  # fmt: skip
BASE_FORMS = ("log", "ore", "dust", "seed", "leaf", "shell")
CRAFTED_FORMS = (
    "plank", "stick", "ingot", "block", "brick", "rope",
    "wheel", "box", "lamp", "cart", "chest", "tool",
)  # fmt: skip
# hash bucket (of 4) of a goal tree -> the only split that may use it
SPLIT_BUCKETS = {"test": (0,), "val": (1,), "train": (2, 3)}
BRANCH_P = 0.3  # depth >= 3: chance a recipe also needs a second, depth-1 crafted item
BASE_P = 0.75  # depth >= 2: chance a recipe also needs a base item next to the crafted one
SHARE_P = 0.5  # chance a distractor (after the first, which always does) eats a goal item
ERROR_KINDS = (
    "bad_count",  # get N with N outside 1..max_get
    "unknown_item",  # an item (goal or ingredient) this world does not have
    "not_base",  # get of an item that must be crafted
    "no_recipe",  # craft of a base item
    "wrong_ingredients",  # the ingredient names differ from the item's recipe
    "wrong_count",  # the names match the recipe, a count does not
    "missing_items",  # the recipe is right, a base ingredient is short in the inventory
    "out_of_order",  # the recipe is right, a crafted ingredient has not been crafted yet
)
NOOP = "inventory"

INSTRUCTION = (
    "Craft the goal item. Each turn, reply with one action: get N ITEM to take N of a base "
    "item, craft ITEM using N ITEM, N ITEM to craft one item from exactly the ingredients a "
    "crafting command lists, or inventory to see what you have. Items that no crafting "
    "command makes are base items."
)
INVALID = "Invalid action. Use: get N ITEM, craft ITEM using N ITEM, N ITEM, or inventory."
# Reflection hints (ALGORITHMS.md, "Reflection by hint"): the opening of an assistant turn
# after a flawed step. A turn's action is read after its last "Action:", so a hint ends there
# and the policy writes the action.
HINTS = ("Thought: Wait, let me check my inventory and the recipe before I go on.\nAction:",)

Recipes = dict[str, list[tuple[str, int]]]


def split_key(goal: str, recipes: Recipes) -> str:
    """The goal's recipe tree as canonical text: what splits, and duplicates, are judged by."""
    tree: dict[str, list[list[Any]]] = {}
    stack = [goal]
    while stack:
        item = stack.pop()
        if item in recipes and item not in tree:
            tree[item] = sorted([name, n] for name, n in recipes[item])
            stack.extend(name for name, _ in recipes[item])
    return json.dumps({"goal": goal, "tree": tree}, sort_keys=True)


def split_of(key: str) -> str:
    """The split a goal tree belongs to; the generator only keeps trees of the requested split."""
    bucket = hashlib.sha256(key.encode()).digest()[0] % 4
    return next(split for split, buckets in SPLIT_BUCKETS.items() if bucket in buckets)


def _listing(ingredients: Sequence[tuple[str, int]]) -> str:
    return ", ".join(f"{n} {name}" for name, n in ingredients)


def recipe_line(item: str, ingredients: Sequence[tuple[str, int]]) -> str:
    return f"craft {item} using {_listing(ingredients)}"


def _needs(item: str, ingredients: Sequence[tuple[str, int]]) -> str:
    return f"{item} needs {_listing(ingredients)}."


def _path(goal: str, item: str, recipes: Recipes) -> list[str]:
    """The crafted items from ``goal`` down to ``item`` (both included), following the first
    ingredient with a recipe at each level, as ``plan_order`` descends."""
    path = [goal]
    while path[-1] != item:
        path.append(next(name for name, _ in recipes[path[-1]] if name in recipes))
    return path


def plan_order(goal: str, recipes: Recipes) -> list[str]:
    """The crafted items of the goal's tree, each after its ingredients (the goal last)."""
    order: list[str] = []

    def visit(item: str) -> None:
        for name, _ in recipes.get(item, []):
            visit(name)
        if item in recipes and item not in order:
            order.append(item)

    visit(goal)
    return order


def remaining_work(goal: str, recipes: Recipes, inventory: dict[str, int]) -> int:
    """Crafts plus base units still needed for one ``goal`` given ``inventory`` (held items
    cover the need before it is expanded into its recipe)."""
    stock = dict(inventory)

    def need(item: str, count: int) -> int:
        take = min(stock.get(item, 0), count)
        stock[item] = stock.get(item, 0) - take
        short = count - take
        if short == 0 or item not in recipes:
            return short
        return short + sum(need(name, n * short) for name, n in recipes[item])

    return need(goal, 1)


def _draw(
    rng: random.Random, depth: int, n_distractors: int, max_count: int
) -> tuple[str, Recipes, list[str]]:
    """A goal of ``depth`` with its recipe tree and ``n_distractors`` distractor recipes;
    returns (goal, recipes in listing order, distractor items)."""
    base_pool = [f"{m} {f}" for m in MATERIALS for f in BASE_FORMS]
    crafted_pool = [f"{m} {f}" for m in MATERIALS for f in CRAFTED_FORMS]
    rng.shuffle(base_pool)
    rng.shuffle(crafted_pool)
    recipes: Recipes = {}

    def base() -> tuple[str, int]:  # the pools outlast the largest world (8 distractors)
        return base_pool.pop(), rng.randint(1, max_count)

    def build(d: int) -> str:
        item = crafted_pool.pop()
        if d == 1:
            ingredients = [base() for _ in range(rng.choice((1, 2)))]
        else:
            ingredients = [(build(d - 1), 1)]
            if d >= 3 and rng.random() < BRANCH_P:
                ingredients.append((build(1), 1))
            elif rng.random() < BASE_P:
                ingredients.append(base())
        recipes[item] = ingredients
        return item

    goal = build(depth)
    # Distractors may eat any item of the goal's tree but the goal itself.
    shared = sorted({name for ings in recipes.values() for name, _ in ings})
    distractors: list[str] = []
    for k in range(n_distractors):
        item = crafted_pool.pop()
        ingredients = [base()]  # a fresh base item: never the same ingredients as a goal recipe
        if k == 0 or rng.random() < SHARE_P:
            name = rng.choice(shared)
            count = 1 if name in recipes else rng.randint(1, max_count)
            ingredients.insert(rng.randint(0, 1), (name, count))
        recipes[item] = ingredients
        distractors.append(item)
    listing = list(recipes)
    rng.shuffle(listing)
    return goal, {item: recipes[item] for item in listing}, distractors


class CraftOptions(BaseModel):
    """The options of ``envs.<name>.options`` for craft, checked before any work starts."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    depth_weights: tuple[float, float, float, float] = Field(
        default=(1.0, 1.0, 1.0, 1.0),
        description="Relative frequency of goal depth 1, 2, 3 and 4 (crafts on the longest path).",
    )
    min_distractors: int = Field(default=1, ge=0, le=8, description="Distractor recipes at least.")
    max_distractors: int = Field(default=3, ge=0, le=8, description="Distractor recipes at most.")
    max_count: int = Field(
        default=3, ge=1, le=10, description="Largest count of a base ingredient in a recipe."
    )
    max_get: int = Field(default=10, ge=1, le=99, description="Largest N of one `get N ITEM`.")
    expert_thoughts: bool = Field(
        default=False,
        description="The expert opens the first turn of each crafted item with a ReAct thought "
        "that restates its recipe ('Thought: oak stick needs 2 oak log.'), the episode's first "
        "turn with the recipes from the goal down to that item: the lookup written out.",
    )

    @field_validator("depth_weights")
    @classmethod
    def _weights(cls, weights: tuple[float, ...]) -> tuple[float, ...]:
        if min(weights) < 0 or not sum(weights):
            raise ValueError(f"needs 4 weights >= 0, not all 0, got {list(weights)}")
        return weights

    @field_validator("max_distractors")
    @classmethod
    def _range(cls, value: int, info: ValidationInfo) -> int:
        low = info.data.get("min_distractors", 0)
        if value < low:
            raise ValueError(f"must be >= min_distractors ({low}), got {value}")
        return value

    @field_validator("max_get")
    @classmethod
    def _get(cls, value: int, info: ValidationInfo) -> int:
        count = info.data.get("max_count", 1)
        if value < count:
            raise ValueError(f"must be >= max_count ({count}), got {value}")
        return value


class CraftSuite:
    """Task generator, oracle and episode factory of the ``craft`` environment.

    ``depth_weights``: relative frequency of goal depth 1..4 (the difficulty).
    ``min_distractors``/``max_distractors``: distractor recipes per task; the first one always
    eats an item of the goal's tree. ``max_count``: largest ingredient count of a recipe.
    ``max_get``: largest N one ``get`` may take. ``expert_thoughts``: the expert writes ReAct
    thoughts that restate the recipes it is about to use (``expert``).
    """

    name = "craft"
    instruction = INSTRUCTION
    noop = NOOP  # the action a revision turn may take: it changes nothing
    hints = HINTS  # how a reflection turn opens (stage reflect)
    Options = CraftOptions  # make_suite checks envs.<name>.options against it

    def __init__(
        self,
        depth_weights: Sequence[float] = (1.0, 1.0, 1.0, 1.0),
        min_distractors: int = 1,
        max_distractors: int = 3,
        max_count: int = 3,
        max_get: int = 10,
        expert_thoughts: bool = False,
    ) -> None:
        opts = CraftOptions(
            depth_weights=tuple(depth_weights),  # type: ignore[arg-type]
            min_distractors=min_distractors,
            max_distractors=max_distractors,
            max_count=max_count,
            max_get=max_get,
            expert_thoughts=expert_thoughts,
        )  # a pydantic ValidationError (a ValueError) names the bad argument
        self.opts = opts

    def tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """``n`` distinct tasks of ``split`` (train, val or test); a prefix of a longer call."""
        if split not in SPLIT_BUCKETS:
            raise ValueError(f"unknown split {split!r}; expected one of {sorted(SPLIT_BUCKETS)}")
        opts = self.opts
        tasks: list[Task] = []
        seen: set[str] = set()
        draw = 0
        while len(tasks) < n:
            # one stream per draw: a task does not depend on n, and splits never share streams
            rng = random.Random(f"craft/{split}/{seed}/{draw}")
            draw += 1
            depth = rng.choices((1, 2, 3, 4), weights=opts.depth_weights)[0]
            n_distractors = rng.randint(opts.min_distractors, opts.max_distractors)
            goal, recipes, distractors = _draw(rng, depth, n_distractors, opts.max_count)
            key = split_key(goal, recipes)
            if key in seen or split_of(key) != split:
                continue
            seen.add(key)
            meta: dict[str, Any] = {
                "goal": goal,
                "recipes": {item: [[i, n] for i, n in ings] for item, ings in recipes.items()},
                "plan": plan_order(goal, recipes),
                "distractors": distractors,
                "progress_total": remaining_work(goal, recipes, {}),
                "draw": draw - 1,
            }
            tasks.append(self._task(split, seed, len(tasks), depth, recipes, meta))
        return tasks

    def _task(
        self, split: str, seed: int, idx: int, depth: int, recipes: Recipes, meta: dict[str, Any]
    ) -> Task:
        lines = [recipe_line(item, ings) for item, ings in recipes.items()]
        prompt = "Crafting commands:\n" + "\n".join(lines) + f"\nGoal: craft {meta['goal']}."
        return Task(
            task_id=f"{self.name}-{split}-{idx:06d}",
            env=self.name,
            split=split,
            seed=seed,
            difficulty=depth,
            prompt=prompt,
            answer=meta["goal"],
            meta=meta,
        )

    def expert(self, task: Task) -> list[str]:
        """Bottom-up: for each crafted item of the goal's tree, get its base ingredients, then
        craft it (its crafted ingredients are already made). With ``expert_thoughts`` the first
        turn of each item opens with ``Thought: ITEM needs N A, M B.`` and the episode's first
        turn with that line for every item from the goal down to the first one crafted."""
        world = World.of(task)
        turns: list[str] = []
        for item in plan_order(world.goal, world.recipes):
            first = len(turns)
            for name, n in world.recipes[item]:
                if name not in world.recipes:
                    while n > 0:  # a count above max_get takes several gets
                        turns.append(f"get {min(n, self.opts.max_get)} {name}")
                        n -= min(n, self.opts.max_get)
            turns.append(recipe_line(item, world.recipes[item]))
            if self.opts.expert_thoughts:
                path = _path(world.goal, item, world.recipes) if first == 0 else [item]
                thought = " ".join(_needs(i, world.recipes[i]) for i in path)
                turns[first] = f"Thought: {thought}\nAction: {turns[first]}"
        return turns

    def make(self) -> CraftEnv:
        return CraftEnv(max_get=self.opts.max_get)


@dataclass(frozen=True)
class World:
    """What an episode needs from a task: the goal and every recipe (item -> ingredients)."""

    goal: str
    recipes: Recipes
    items: frozenset[str]  # every item of the world, base and crafted
    total: int  # the goal's plan in units: its crafts plus its base items

    @classmethod
    def of(cls, task: Task) -> World:
        """From ``task.meta``'s ``goal`` and ``recipes`` alone (a hand-written task works)."""
        goal = str(task.meta["goal"])
        recipes = {
            item: [(str(name), int(n)) for name, n in ings]
            for item, ings in task.meta["recipes"].items()
        }
        items = set(recipes) | {name for ings in recipes.values() for name, _ in ings}
        total = remaining_work(goal, recipes, {})
        return cls(goal=goal, recipes=recipes, items=frozenset(items), total=total)


@dataclass(frozen=True)
class Get:
    item: str
    count: int


@dataclass(frozen=True)
class Craft:
    item: str
    ingredients: tuple[tuple[str, int], ...]  # as written: a name may repeat


@dataclass(frozen=True)
class Inventory:
    pass


Command = Get | Craft | Inventory

_NAME = r"[a-z]+(?: [a-z]+)*"
_GET = re.compile(rf"get (?:(\d+) )?({_NAME})")
_CRAFT = re.compile(rf"craft ({_NAME}) using (.+)")
_INGREDIENT = re.compile(rf"(?:(\d+) )?({_NAME})")


def action_line(text: str) -> str:
    """The action of a ReAct turn: the first non-empty line after the last ``Action:``, or of
    the whole turn when it has none; lowercased, spaces collapsed, a final period dropped."""
    _, marker, after = text.rpartition("Action:")
    lines = (" ".join(line.split()) for line in (after if marker else text).splitlines())
    line = next((line for line in lines if line), "")
    return line.lower().removesuffix(".").strip()


def parse_command(text: str) -> Command | None:
    """The turn's command, or None when it does not parse (an invalid action)."""
    line = action_line(text)
    if line == "inventory":
        return Inventory()
    if match := _GET.fullmatch(line):
        return Get(match.group(2), int(match.group(1) or 1))
    if match := _CRAFT.fullmatch(line):
        ingredients = []
        for part in match.group(2).split(","):
            ing = _INGREDIENT.fullmatch(part.strip())
            if ing is None:
                return None
            ingredients.append((ing.group(2), int(ing.group(1) or 1)))
        return Craft(match.group(1), tuple(ingredients))
    return None


def canonical(command: Command) -> str:
    """One text per meaning: counts written out, ingredients merged and sorted by name."""
    if isinstance(command, Inventory):
        return NOOP
    if isinstance(command, Get):
        return f"get {command.count} {command.item}"
    return recipe_line(command.item, sorted(_merge(command.ingredients).items()))


def _merge(ingredients: Sequence[tuple[str, int]]) -> dict[str, int]:
    merged: dict[str, int] = {}
    for name, n in ingredients:
        merged[name] = merged.get(name, 0) + n
    return merged


def _inventory_text(inventory: dict[str, int]) -> str:
    held = [f"{n} {item}" for item, n in inventory.items() if n > 0]
    return "Inventory: " + (", ".join(held) if held else "empty") + "."


class CraftEnv:
    """One ``craft`` episode at a time; ``snapshot``/``restore`` copy its whole state."""

    def __init__(self, max_get: int = 10) -> None:
        self.max_get = max_get
        self._task: Task | None = None
        self._world: World | None = None
        self._inventory: dict[str, int] = {}
        self._done = False

    def reset(self, task: Task) -> str:
        self._task, self._world = task, World.of(task)
        self._inventory, self._done = {}, False
        return task.prompt

    def progress(self) -> int:
        """Units of the goal's plan done (0 at the start, ``progress_total`` at the goal)."""
        world = self._require()
        return world.total - remaining_work(world.goal, world.recipes, self._inventory)

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        world = self._require()
        if self._done:
            task_id = self._task.task_id if self._task is not None else "?"
            raise RuntimeError(f"episode {task_id} is done; call reset() first")
        before = self.progress()
        info: dict[str, Any] = {"tool_call": False, "tool_error": False, "tool_ok": False}
        info.update(invalid=False, error=False, error_kind="", success=False, action="")
        command = parse_command(action)
        if command is None:
            info["invalid"] = True
            observation = INVALID
        else:
            info["action"] = canonical(command)
            observation, kind = self._apply(world, command)
            info.update(error=bool(kind), error_kind=kind)
        reward = 0.0
        if self._inventory.get(world.goal, 0) > 0:
            self._done, reward = True, 1.0
            info["success"] = True
            observation += " Goal done."
        after = self.progress()
        info.update(progress=after, progress_total=world.total, lost_progress=after < before)
        return observation, reward, self._done, info

    def _apply(self, world: World, command: Command) -> tuple[str, str]:
        """Carry out a parsed command: (observation, error kind or "")."""
        if isinstance(command, Inventory):
            return _inventory_text(self._inventory), ""
        if isinstance(command, Get):
            return self._get(world, command)
        return self._craft(world, command)

    def _get(self, world: World, command: Get) -> tuple[str, str]:
        item, count = command.item, command.count
        if not 1 <= count <= self.max_get:
            return f"Could not get {count} {item}: get 1 to {self.max_get} at a time.", "bad_count"
        if item not in world.items:
            return f"Could not find {item}.", "unknown_item"
        if item in world.recipes:
            return f"Could not get {item}: craft it.", "not_base"
        self._inventory[item] = self._inventory.get(item, 0) + count
        return f"Got {count} {item}.", ""

    def _craft(self, world: World, command: Craft) -> tuple[str, str]:
        item = command.item
        unknown = [n for n in (item, *(i for i, _ in command.ingredients)) if n not in world.items]
        if unknown:
            return f"Could not find {unknown[0]}.", "unknown_item"
        if item not in world.recipes:
            return f"Could not craft {item}: get it.", "no_recipe"
        given, recipe = _merge(command.ingredients), dict(world.recipes[item])
        if set(given) != set(recipe):
            return f"Could not craft {item}: wrong ingredients.", "wrong_ingredients"
        if given != recipe:
            return f"Could not craft {item}: wrong counts.", "wrong_count"
        short = [(n, k) for n, k in world.recipes[item] if self._inventory.get(n, 0) < k]
        crafted = [n for n, _ in short if n in world.recipes]
        if crafted:
            return f"Could not craft {item}: craft {crafted[0]} first.", "out_of_order"
        if short:
            name, need = short[0]
            have = self._inventory.get(name, 0)
            return f"Could not craft {item}: need {need} {name}, have {have}.", "missing_items"
        for name, n in recipe.items():
            self._inventory[name] -= n
            if not self._inventory[name]:
                del self._inventory[name]
        self._inventory[item] = self._inventory.get(item, 0) + 1
        return f"Crafted 1 {item}.", ""

    def snapshot(self) -> dict[str, Any]:
        """The whole episode state (a copy: stepping on does not change it)."""
        return {"task": self._task, "inventory": dict(self._inventory), "done": self._done}

    def restore(self, state: dict[str, Any]) -> None:
        """Back to ``state``, on this env or a fresh one from ``make()``; reusable."""
        task = state["task"]
        self._task, self._world = task, World.of(task) if task is not None else None
        self._inventory, self._done = dict(state["inventory"]), state["done"]

    def close(self) -> None:
        self._task, self._world, self._inventory, self._done = None, None, {}, False

    def _require(self) -> World:
        if self._world is None:
            raise RuntimeError("CraftEnv.step() before reset()")
        return self._world
