"""The craft suite: deterministic disjoint splits, graded depths with distractors, a perfect
oracle through real envs, every error kind and lost progress in ``info``, native snapshots."""

from __future__ import annotations

import random
import re
from typing import Any

import pytest

from flywheel.agent import expert_episodes
from flywheel.config import ConfigError, EnvConfig
from flywheel.envs import make_suite, row_to_task, task_to_row
from flywheel.envs.base import Env, EnvSuite, Task, has_snapshot
from flywheel.envs.craft import (
    ERROR_KINDS,
    INVALID,
    CraftEnv,
    CraftSuite,
    parse_command,
    recipe_line,
    split_key,
    split_of,
)

# goal: iron wheel <- oak stick <- 2 oak log, plus 2 iron ore; three distractors, two of which
# eat a goal item (the stick, the ore) and one that does not.
HAND = {
    "goal": "iron wheel",
    "recipes": {
        "iron wheel": [["oak stick", 1], ["iron ore", 2]],
        "oak stick": [["oak log", 2]],
        "blue box": [["oak stick", 1], ["sand dust", 1]],
        "red rope": [["iron ore", 2]],
        "gold lamp": [["clay seed", 1]],
    },
}
HAND_TOTAL = 6  # 2 crafts + 2 oak log + 2 iron ore


def hand_task() -> Task:
    lines = [recipe_line(i, [(n, c) for n, c in r]) for i, r in HAND["recipes"].items()]
    prompt = "Crafting commands:\n" + "\n".join(lines) + "\nGoal: craft iron wheel."
    return Task("craft-hand", "craft", "test", 0, 2, prompt, "iron wheel", dict(HAND))


def play(env: Env, actions: list[str]) -> list[tuple[str, float, bool, dict[str, Any]]]:
    return [env.step(a) for a in actions]


def tree_of(task: Task) -> set[str]:
    """Every item the goal's recipe tree uses, the goal included (computed independently)."""
    recipes, seen, todo = task.meta["recipes"], set(), [task.meta["goal"]]
    while todo:
        item = todo.pop()
        seen.add(item)
        todo.extend(name for name, _ in recipes.get(item, []))
    return seen


def depth_of(item: str, recipes: dict[str, Any]) -> int:
    if item not in recipes:
        return 0
    return 1 + max(depth_of(name, recipes) for name, _ in recipes[item])


def test_implements_the_protocol_and_is_built_in() -> None:
    suite = make_suite(EnvConfig(name="craft", options={"max_distractors": 4}))
    assert isinstance(suite, CraftSuite) and isinstance(suite, EnvSuite)
    assert suite.opts.max_distractors == 4
    env = suite.make()
    assert isinstance(env, Env) and has_snapshot(env)
    for bad, match in [
        ({"colour": 1}, "unknown option envs.craft.options.colour"),
        ({"min_distractors": 3, "max_distractors": 2}, "max_distractors: must be >= min"),
        ({"depth_weights": [0, 0, 0, 0]}, "depth_weights"),
        ({"max_count": 5, "max_get": 4}, "max_get: must be >= max_count"),
    ]:
        with pytest.raises(ConfigError, match=match):
            make_suite(EnvConfig(name="craft", options=bad))


def test_tasks_are_deterministic_and_prefix_stable() -> None:
    suite = CraftSuite()
    first = suite.tasks("train", 40, seed=7)
    assert first == suite.tasks("train", 40, seed=7)
    assert first[:10] == suite.tasks("train", 10, seed=7)
    assert [t.prompt for t in first] != [t.prompt for t in suite.tasks("train", 40, seed=8)]
    assert first[3].task_id == "craft-train-000003"
    assert all(t.env == "craft" and t.split == "train" and t.seed == 7 for t in first)
    with pytest.raises(ValueError, match="unknown split"):
        suite.tasks("dev", 1, seed=0)


def test_splits_never_share_a_goal_tree() -> None:
    suite = CraftSuite(depth_weights=(1, 0, 0, 0))  # the smallest space of trees
    keys = {}
    for split, n in (("train", 900), ("val", 300), ("test", 300)):
        tasks = suite.tasks(split, n, seed=0)
        keys[split] = {split_key(t.meta["goal"], _recipes(t)) for t in tasks}
        assert len(keys[split]) == n  # no goal tree twice within a split either
        assert {split_of(k) for k in keys[split]} == {split}
    assert not keys["train"] & keys["test"] and not keys["train"] & keys["val"]
    assert not keys["val"] & keys["test"]


def _recipes(task: Task) -> dict[str, list[tuple[str, int]]]:
    return {i: [(n, c) for n, c in r] for i, r in task.meta["recipes"].items()}


def test_depths_are_graded_and_true_to_the_recipes() -> None:
    tasks = CraftSuite().tasks("train", 400, seed=1)
    assert {t.difficulty for t in tasks} == {1, 2, 3, 4}
    assert all(50 < sum(t.difficulty == d for t in tasks) < 150 for d in (1, 2, 3, 4))
    for task in tasks:
        assert depth_of(task.meta["goal"], task.meta["recipes"]) == task.difficulty
        assert task.answer == task.meta["goal"]
        assert task.prompt.endswith(f"Goal: craft {task.answer}.")
    deep = CraftSuite(depth_weights=(0, 0, 0, 1)).tasks("test", 30, seed=0)
    assert {t.difficulty for t in deep} == {4}


def test_distractors_are_listed_unneeded_and_some_eat_goal_items() -> None:
    suite = CraftSuite(min_distractors=1, max_distractors=3)
    tasks = suite.tasks("train", 300, seed=2)
    counts = set()
    for task in tasks:
        recipes, tree = task.meta["recipes"], tree_of(task)
        distractors = task.meta["distractors"]
        counts.add(len(distractors))
        assert not set(distractors) & tree
        assert set(recipes) == (tree & set(recipes)) | set(distractors)
        # the first distractor always eats an item of the goal's tree
        assert {n for n, _ in recipes[distractors[0]]} & tree
        lines = task.prompt.splitlines()
        assert lines[0] == "Crafting commands:" and len(lines) == len(recipes) + 2
        for item, ings in recipes.items():
            assert recipe_line(item, [(n, c) for n, c in ings]) in lines
    assert counts == {1, 2, 3}
    none = CraftSuite(min_distractors=0, max_distractors=0).tasks("val", 20, seed=0)
    assert all(not t.meta["distractors"] for t in none)


def test_vocabulary_and_numbers_stay_small() -> None:
    suite = CraftSuite()
    tasks = suite.tasks("train", 500, seed=3)
    text = " ".join([suite.instruction, *(t.prompt for t in tasks)])
    text += " ".join(a for t in tasks for a in suite.expert(t))
    words = set(re.findall(r"[A-Za-z]+", text.lower()))
    assert 30 < len(words) < 80, sorted(words)
    assert max(int(n) for n in re.findall(r"\d+", text)) <= 10


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_oracle_solves_every_task_through_real_envs(depth: int) -> None:
    weights = [0.0] * 4
    weights[depth - 1] = 1.0
    suite = CraftSuite(depth_weights=weights, max_distractors=4)
    tasks = suite.tasks("train", 25, seed=4) + suite.tasks("test", 25, seed=4)
    rows = expert_episodes(suite, tasks)
    assert all(r["success"] and r["reward"] == 1.0 for r in rows)
    assert all(r["finish_reason"] == "done" and r["invalid_actions"] == 0 for r in rows)
    assert [r["steps"] for r in rows] == [len(suite.expert(t)) for t in tasks]


def test_expert_thoughts_write_the_recipe_lookup_and_still_solve() -> None:
    task = hand_task()
    plain = CraftSuite().expert(task)
    turns = CraftSuite(expert_thoughts=True).expert(task)
    assert turns == [
        "Thought: iron wheel needs 1 oak stick, 2 iron ore. oak stick needs 2 oak log.\n"
        "Action: get 2 oak log",
        "craft oak stick using 2 oak log",
        "Thought: iron wheel needs 1 oak stick, 2 iron ore.\nAction: get 2 iron ore",
        "craft iron wheel using 1 oak stick, 2 iron ore",
    ]
    assert [parse_command(t) for t in turns] == [parse_command(t) for t in plain]
    suite = CraftSuite(depth_weights=[0, 0, 1, 1], max_distractors=4, expert_thoughts=True)
    tasks = suite.tasks("train", 30, seed=6)
    assert all(r["success"] for r in expert_episodes(suite, tasks))
    for task in tasks:  # the first thought descends from the goal to the first item crafted
        first = suite.expert(task)[0]
        assert first.startswith(f"Thought: {task.meta['goal']} needs ")
        assert first.count(" needs ") == len(_chain(task))


def _chain(task: Task) -> list[str]:
    recipes, item, chain = task.meta["recipes"], task.meta["goal"], []
    while item in recipes:
        chain.append(item)
        item = next((n for n, _ in recipes[item] if n in recipes), "")
    return chain


def test_oracle_progress_climbs_to_the_total_without_errors() -> None:
    suite = CraftSuite()
    env = suite.make()
    for task in suite.tasks("val", 60, seed=5):
        task = row_to_task(task_to_row(task))  # the env reads a task back from its row
        env.reset(task)
        progress = 0
        for action in suite.expert(task):
            _, reward, done, info = env.step(action)
            assert not (info["error"] or info["invalid"] or info["lost_progress"]), action
            assert info["progress"] > progress  # every oracle step is useful
            assert not (info["tool_call"] or info["tool_ok"] or info["tool_error"])
            progress = info["progress"]
        assert done and reward == 1.0 and info["success"]
        assert progress == info["progress_total"] == task.meta["progress_total"]


def test_actions_parse_from_react_turns() -> None:
    env = CraftEnv()
    env.reset(hand_task())
    obs, _, _, info = env.step("Thought: logs first.\nAction: Get 2  Oak Log.")
    assert obs == "Got 2 oak log." and info["action"] == "get 2 oak log"
    assert env.step("get iron ore")[0] == "Got 1 iron ore."
    obs, _, _, info = env.step("Action:\n\ncraft oak stick using 2 oak log")
    assert obs == "Crafted 1 oak stick." and info["action"] == "craft oak stick using 2 oak log"
    assert env.step("inventory")[0] == "Inventory: 1 iron ore, 1 oak stick."
    assert parse_command("craft a b using 1 c d, e f") is not None
    merged = env.step("craft iron wheel using 1 iron ore, 1 oak stick, 1 iron ore")[3]["action"]
    assert merged == "craft iron wheel using 2 iron ore, 1 oak stick"  # canonical: merged, sorted


@pytest.mark.parametrize(
    "text",
    ["dance", "", "Thought: hmm", "craft oak stick", "get", "get 2", "craft x using , 2 oak log"],
)
def test_unparseable_actions_are_invalid_and_change_nothing(text: str) -> None:
    env = CraftEnv()
    env.reset(hand_task())
    play(env, ["get 2 oak log"])
    obs, reward, done, info = env.step(text)
    assert obs == INVALID and reward == 0.0 and not done
    assert info["invalid"] and not info["error"] and info["error_kind"] == ""
    assert info["action"] == "" and info["progress"] == 2 and not info["lost_progress"]


ERRORS = [
    ([], "get 11 oak log", "bad_count", "get 1 to 10 at a time"),
    ([], "get 0 oak log", "bad_count", "Could not get 0 oak log"),
    ([], "get 2 pine log", "unknown_item", "Could not find pine log."),
    ([], "craft pine stick using 2 oak log", "unknown_item", "Could not find pine stick."),
    (["get 2 oak log"], "craft oak stick using 2 pine log", "unknown_item", "find pine log"),
    ([], "get oak stick", "not_base", "Could not get oak stick: craft it."),
    (["get 2 iron ore"], "craft oak log using 2 iron ore", "no_recipe", "oak log: get it."),
    (["get 2 oak log"], "craft oak stick using 2 iron ore", "wrong_ingredients", "wrong ingr"),
    (["get 2 iron ore"], "craft iron wheel using 2 iron ore", "wrong_ingredients", "wrong ingr"),
    (["get 3 oak log"], "craft oak stick using 3 oak log", "wrong_count", "wrong counts."),
    (["get 2 oak log"], "craft oak stick using oak log", "wrong_count", "wrong counts."),
    (
        ["get 1 oak log"],
        "craft oak stick using 2 oak log",
        "missing_items",
        "need 2 oak log, have 1",
    ),
    (
        ["get 2 iron ore"],
        "craft iron wheel using 1 oak stick, 2 iron ore",
        "out_of_order",
        "craft oak stick first.",
    ),
]


def test_every_error_kind_is_covered() -> None:
    assert {kind for _, _, kind, _ in ERRORS} == set(ERROR_KINDS)


@pytest.mark.parametrize(("setup", "action", "kind", "says"), ERRORS)
def test_failed_actions_name_their_kind_and_change_nothing(
    setup: list[str], action: str, kind: str, says: str
) -> None:
    env = CraftEnv(max_get=10)
    env.reset(hand_task())
    before = play(env, [*setup, "inventory"])
    obs, reward, done, info = env.step(action)
    assert says in obs and obs.startswith("Could not")
    assert (reward, done, info["success"], info["invalid"]) == (0.0, False, False, False)
    assert info["error"] and info["error_kind"] == kind
    assert info["progress"] == before[-1][3]["progress"] and not info["lost_progress"]
    assert env.step("inventory")[0] == before[-1][0]  # the inventory is untouched


def test_lost_progress_when_a_craft_eats_what_the_goal_needs() -> None:
    env = CraftEnv()
    env.reset(hand_task())
    steps = play(env, ["get 2 oak log", "craft oak stick using 2 oak log", "get 2 iron ore"])
    assert [s[3]["progress"] for s in steps] == [2, 3, 5]
    assert not any(s[3]["lost_progress"] for s in steps)
    _, _, _, info = env.step("get 1 sand dust")  # not on the goal's path: no progress
    assert info["progress"] == 5 and not info["lost_progress"]
    _, _, _, info = env.step("craft blue box using 1 oak stick, 1 sand dust")  # eats the stick
    assert not info["error"] and info["lost_progress"] and info["progress"] == 2
    _, _, _, info = env.step("craft red rope using 2 iron ore")  # eats the ore
    assert info["lost_progress"] and info["progress"] == 0
    play(env, ["get 1 clay seed"])
    _, _, _, info = env.step("craft gold lamp using 1 clay seed")  # eats nothing the goal needs
    assert not info["lost_progress"] and info["progress"] == 0 and info["progress_total"] == 6


def test_eating_a_surplus_is_no_lost_progress_and_the_goal_ends_the_episode() -> None:
    env = CraftEnv()
    env.reset(hand_task())
    steps = play(env, ["get 4 iron ore", "craft red rope using 2 iron ore"])
    assert steps[0][3]["progress"] == steps[1][3]["progress"] == 2
    assert not steps[1][3]["lost_progress"]
    play(env, ["get 2 oak log", "craft oak stick using 2 oak log"])
    obs, reward, done, info = env.step("craft iron wheel using 1 oak stick, 2 iron ore")
    assert obs == "Crafted 1 iron wheel. Goal done." and reward == 1.0 and done
    assert info["success"] and info["progress"] == HAND_TOTAL
    with pytest.raises(RuntimeError, match="done"):
        env.step("inventory")


def random_actions(suite: CraftSuite, task: Task, rng: random.Random, n: int) -> list[str]:
    """Plausible play: the oracle's next move half the time, else a random get, a craft of a
    listed recipe (right or wrong counts), a distractor made from scratch, or a no-op."""
    expert, items = suite.expert(task), sorted(tree_of(task) | set(task.meta["recipes"]))
    recipes = task.meta["recipes"]
    lines = task.prompt.splitlines()[1:-1]
    actions: list[str] = []
    while len(actions) < n:
        roll = rng.random()
        if roll < 0.5 and expert:
            actions.append(expert.pop(0))
        elif roll < 0.65:
            actions.append(f"get {rng.randint(0, 11)} {rng.choice(items)}")
        elif roll < 0.8:
            actions.append(rng.choice(lines).replace(" 1 ", f" {rng.randint(1, 2)} "))
        elif roll < 0.9:
            item = rng.choice(task.meta["distractors"])
            ings = [(name, c) for name, c in recipes[item]]
            actions += [f"get {c} {name}" for name, c in ings if name not in recipes]
            actions.append(recipe_line(item, ings))
        else:
            actions.append(rng.choice(["inventory", "jump", "craft it", "Action: inventory"]))
    return actions[:n]


def run(env: Env, actions: list[str]) -> list[tuple[str, float, bool, dict[str, Any]]]:
    """Step until done or out of actions."""
    out = []
    for action in actions:
        out.append(env.step(action))
        if out[-1][2]:
            break
    return out


def test_restoring_a_snapshot_replays_the_same_future() -> None:
    suite = CraftSuite()
    rng = random.Random(0)
    ended = lost = 0
    for task in suite.tasks("train", 40, seed=6):
        actions = random_actions(suite, task, rng, 16)
        k = rng.randint(0, 8)
        env = suite.make()
        env.reset(task)
        prefix = run(env, actions[:k])
        if prefix and prefix[-1][2]:
            continue
        state = env.snapshot()
        original = run(env, actions[k:])
        ended += original[-1][2]
        lost += any(s[3]["lost_progress"] for s in original)
        env.restore(state)  # the same env, after it went on (maybe to done)
        assert run(env, actions[k:]) == original
        fresh = suite.make()  # a fresh env, never reset
        fresh.restore(state)
        assert run(fresh, actions[k:]) == original
        env.restore(state)  # a state restores more than once
        assert run(env, actions[k:]) == original
    assert ended and lost  # the sequences reached the goal and lost progress at times
