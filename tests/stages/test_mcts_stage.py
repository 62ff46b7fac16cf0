"""stages.mcts and stages.splice on the craft env with the tiny policy: mcts writes valid trees
(one batched generate call per tree level, every node's observation the one a fresh env gives
on replaying its path, a tree.png) and resumes after a SIGKILL keeping its finished shards;
splice on a hand-built trees artifact writes revision rows (source=revision) and good paths
(source=mcts) with the right loss flags and the env's real answer to the revision turn, by the
rule verifier and by the policy as judge. Also the round's config shape (iteration.data) and
evaluate's recovery count, which replays episodes the same way."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

import stages.evaluate
import stages.expert
import stages.init
import stages.mcts
import stages.splice
import stages.tasks
from flows.flywheel import check_plan
from flywheel.config import Config, ConfigError, load_config
from flywheel.envs import make_suite
from flywheel.mcts import Child, Node, Tree, backup, path, paths, settle, to_rows, trees_from_rows
from flywheel.metrics import summarize
from flywheel.splice import RULE_KEYS
from flywheel.store import ArtifactRef, ArtifactWriter, Store
from stages._common import load_tasks
from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
CRAFT = "{name: craft, n_train: 24, n_val: 8, n_test: 8, max_steps: 4}"
SEARCH = ("mcts.n_tasks=6", "mcts.shard_size=2", "mcts.iterations=2", "mcts.max_depth=3",
          "mcts.n_gen=3")  # fmt: skip
# Trees whose leaves come in 3 distinct actions at most, in 24 shards of one tree each: small
# and many, so that the kill falls between shards.
SLOW = ("mcts.shard_size=1", "mcts.iterations=3", "mcts.max_depth=3", "mcts.n_gen=3")


def craft_overrides(root: Path, *extra: str) -> list[str]:
    return tiny_overrides(
        root, f"envs=[{CRAFT}]", "iteration.data=[mcts]", "iteration.steps=[sft]",
        "baselines=[sft_more]", *extra,
    )  # fmt: skip


def bootstrap(overrides: list[str]) -> tuple[Config, Store, dict[str, ArtifactRef]]:
    """The config, its store and the tasks and init artifacts of a run with ``overrides``."""
    cfg = load_config(None, overrides)
    store = Store(cfg.run.store_root(), cfg.run.name)
    with contextlib.redirect_stdout(io.StringIO()):
        train, val, test = stages.tasks.run(cfg, store)
        init = stages.init.run(cfg, store, stages.expert.run(cfg, store, train, val), train)
    return cfg, store, {"train": train, "test": test, "init": init}


def prepare(root: Path, *extra: str) -> tuple[list[str], Config, Store, dict[str, ArtifactRef]]:
    overrides = craft_overrides(root, *extra)
    return overrides, *bootstrap(overrides)


@pytest.fixture(scope="module")
def boot(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("craft"), *SEARCH)


class Counting:
    """The real engine, with the chats of every generate call recorded."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, chats, params):
        self.calls.append([(tuple(c.messages[-1].values()), len(c.messages)) for c in chats])
        return self.engine.generate(chats, params)

    def close(self):
        self.engine.close()


def replayed_observation(suite, task, node: Node) -> str:
    """What a fresh env answers at ``node`` when the turns from the root are stepped again."""
    env = suite.make()
    env.reset(task)
    observation = ""
    for step in path(node)[1:]:
        observation = env.step(step.text)[0]
    return observation


def test_mcts_writes_valid_trees(boot):
    _, cfg, store, refs = boot
    with contextlib.redirect_stdout(io.StringIO()):
        ref = stages.mcts.run(cfg, store, refs["init"], refs["train"], round=1)
    assert ref.kind == "trees" and ref.inputs == [refs["init"].id, refs["train"].id]
    assert len(ref.manifest["shards"]) == 3  # 6 trees, 2 per shard
    trees = trees_from_rows(store.read(ref).to_pylist())  # validated against the contract
    assert len(trees) == 6 and len({t.tree_id for t in trees}) == 6
    suite = make_suite(cfg.envs[0])
    tasks = {t.task_id: t for t in load_tasks(store, refs["train"], env="craft", split="train")}
    for tree in trees:
        root = tree.root
        assert [m["content"] for m in tree.opening[:2]] == [suite.instruction, "Ok."]
        assert tree.opening[2]["content"] == tasks[tree.task_id].prompt
        leaves = [p[-1] for p in paths(tree)]
        assert root.visits == len(leaves) >= 1
        assert root.value == pytest.approx(sum(n.reward for n in leaves) / len(leaves))
        for node in tree.nodes[1:]:
            assert (
                1 <= node.depth <= 3
                and node.token_ids
                and len(node.logprobs) == len(node.token_ids)
            )
            # the child was stepped from its parent's restored snapshot: a fresh env replaying
            # the path from the root answers the same
            assert node.observation == replayed_observation(suite, tasks[tree.task_id], node)
            assert "progress" in node.info  # the env's own info, kept as JSON
        for node in tree.nodes:
            if node.children:
                assert len({c.action or c.text for c in node.children}) == len(node.children)
    assert ref.summary["craft/trees"] == 6
    nodes = sum(len(t.nodes) for t in trees) / 6
    assert ref.summary["craft/nodes_per_tree"] == pytest.approx(nodes)
    assert ref.summary["craft/success_share"] == pytest.approx(
        sum(any(n.success for n in t.nodes) for t in trees) / 6
    )
    png = Path(ref.path) / stages.mcts.PLOT
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_expansions_of_all_trees_share_one_generate_call_per_level(boot):
    _, cfg, store, refs = boot
    from flywheel.checkpoint import load_policy
    from flywheel.engines.hf import HFEngine

    model, tokenizer = load_policy(store, refs["init"])
    engine = Counting(HFEngine(model, tokenizer, batch_size=64))
    suite = make_suite(cfg.envs[0])
    tasks = load_tasks(store, refs["train"], env="craft", split="train", limit=5)
    trees = stages.mcts.search_trees(cfg, engine, suite, tasks, seed=3)  # type: ignore[arg-type]
    mc = cfg.mcts
    assert len(engine.calls) <= mc.iterations * mc.max_depth
    first = engine.calls[0]
    assert len(first) == 5 * mc.n_gen  # every root, n_gen times, in the first call
    for call in engine.calls:  # each leaf's chat n_gen times in a row
        assert len(call) % mc.n_gen == 0
        groups = [call[i : i + mc.n_gen] for i in range(0, len(call), mc.n_gen)]
        assert all(len(set(g)) == 1 for g in groups)
    expanded = sum(1 for t in trees for n in t.nodes if n.children)
    assert sum(len(c) for c in engine.calls) >= expanded * mc.n_gen


def reference_trees(cfg, engine, suite, tasks, seed):
    """The search as stages.mcts wrote it before its expansions and steps went through the
    agent loop's Episode: chats built by hand from the path, env stepped by hand."""
    from dataclasses import replace

    from flywheel.agent import derive_seed
    from flywheel.engines.base import Chat, SamplingParams
    from flywheel.envs.snapshot import branchable
    from flywheel.mcts import conversation, search
    from flywheel.trajectory import align_turn_ids

    trees, envs = [], []
    for task in tasks:
        env = branchable(suite.make)
        envs.append(env)
        opening = [
            {"role": "user", "content": suite.instruction, "loss": False},
            {"role": "assistant", "content": "Ok.", "loss": False},
            {"role": "user", "content": env.reset(task), "loss": False},
        ]
        tree = Tree(f"{task.task_id}:0", task.task_id, suite.name, task.split, seed, opening)
        tree.state, tree.root.state = env, env.snapshot()
        trees.append(tree)
    sampling = SamplingParams(temperature=cfg.mcts.temperature,
                              max_new_tokens=cfg.engine.max_new_tokens)  # fmt: skip
    calls = [0]
    level_seed = derive_seed(seed, 0)

    def expand(leaves, n_gen):
        chats = []
        for leaf in leaves:
            traj = conversation(leaf)
            plain = [{"role": m["role"], "content": m["content"]} for m in traj.messages]
            chats += [Chat(plain, align_turn_ids(plain, traj.turn_token_ids))] * n_gen
        params = replace(sampling, seed=derive_seed(level_seed, "level", calls[0]))
        calls[0] += 1
        gens = engine.generate(chats, params)
        return [
            [Child(g.text, list(g.token_ids), list(g.logprobs), stages.mcts.action_of(g.text))
             for g in gens[i * n_gen : (i + 1) * n_gen]]
            for i in range(len(leaves))
        ]  # fmt: skip

    def step(node):
        env = node.tree.state
        env.restore(node.parent.state)
        outcome = env.step(node.text)
        node.state = env.snapshot()
        return outcome

    mc = cfg.mcts
    search(trees, expand, step, iterations=mc.iterations, max_depth=mc.max_depth,
           n_gen=mc.n_gen, c=mc.c, seed=derive_seed(seed, "uct", 0))  # fmt: skip
    for env in envs:
        env.close()
    return trees


def test_trees_of_a_fixed_seed_are_those_of_the_hand_written_search(boot):
    """Expanding and stepping through Episode changes no row of a seeded search."""
    _, cfg, store, refs = boot
    from flywheel.checkpoint import load_policy
    from flywheel.engines.hf import HFEngine

    model, tokenizer = load_policy(store, refs["init"])
    suite = make_suite(cfg.envs[0])
    tasks = load_tasks(store, refs["train"], env="craft", split="train", limit=4)
    ours = stages.mcts.search_trees(cfg, HFEngine(model, tokenizer), suite, tasks, seed=11)
    theirs = reference_trees(cfg, HFEngine(model, tokenizer), suite, tasks, seed=11)
    rows = [row for tree in ours for row in to_rows(tree)]
    assert len(rows) > 4 * 2  # the trees grew
    assert rows == [row for tree in theirs for row in to_rows(tree)]


# -- SIGKILL and resume ---------------------------------------------------------------------------

CHILD = """
import json, sys
from flywheel.config import load_config
from flywheel.store import Store
import stages.mcts
cfg = load_config(None, json.loads(sys.argv[1]))
store = Store(cfg.run.store_root(), cfg.run.name)
stages.mcts.run(cfg, store, store.get(sys.argv[2]), store.get(sys.argv[3]), round=1)
print("CHILD FINISHED", flush=True)
"""


def kill_after_first_shard(overrides, policy_id, tasks_id, stage_dir: Path, log: Path) -> Path:
    """Start mcts in a child, SIGKILL it once a shard is written but no manifest exists."""
    with open(log, "w") as out:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(overrides), policy_id, tasks_id],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline:
            tmp = next(iter(stage_dir.glob(".tmp-mcts-*")), None) if stage_dir.exists() else None
            if tmp is not None and list(tmp.glob("part-*.parquet")):
                os.killpg(child.pid, signal.SIGKILL)
                child.wait(30)
                return tmp
            if child.poll() is not None:
                pytest.fail(f"mcts finished before a shard was seen:\n{log.read_text()[-3000:]}")
            time.sleep(0.005)
        pytest.fail(f"no mcts shard within 180s:\n{log.read_text()[-3000:]}")
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(30)


@pytest.mark.integration  # a child process; ~8 s
def test_mcts_killed_mid_run_resumes_keeping_finished_shards(tmp_path):
    overrides, cfg, store, refs = prepare(tmp_path / "a", *SLOW)
    stage_dir = Path(cfg.run.store_root()) / cfg.run.name / "round-1" / "mcts"
    tmp = kill_after_first_shard(
        overrides, refs["init"].id, refs["train"].id, stage_dir, tmp_path / "child.log"
    )
    art_id = tmp.name.removeprefix(".tmp-")
    assert not (tmp / "manifest.json").exists() and not (stage_dir / art_id).exists()
    assert Store(cfg.run.store_root(), cfg.run.name).list(stage="mcts") == []
    before = {
        p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes())
        for p in tmp.glob("part-*.parquet")
    }
    assert 1 <= len(before) < 24, f"{len(before)}/24 shards before the kill"

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ref = stages.mcts.run(cfg, store, refs["init"], refs["train"], round=1)
    printed = out.getvalue()
    assert ref.id == art_id
    assert f"mcts: resuming, {len(before)}/24 shards already written" in printed
    assert printed.count("mcts: shard ") == 24 - len(before)
    final = Path(ref.path)
    for name, (inode, mtime, data) in before.items():
        stat = (final / name).stat()
        assert (stat.st_ino, stat.st_mtime_ns) == (inode, mtime), f"{name} was rewritten"
        assert (final / name).read_bytes() == data
    table = store.read(ref)
    assert len(set(table.column("tree_id").to_pylist())) == 24

    # an uninterrupted run writes the same trees: a shard's search is seeded by its index
    _, cfg_b, store_b, refs_b = prepare(tmp_path / "b", *SLOW)
    with contextlib.redirect_stdout(io.StringIO()):
        ref_b = stages.mcts.run(cfg_b, store_b, refs_b["init"], refs_b["train"], round=1)
    assert ref_b.id == ref.id
    assert store_b.read(ref_b).equals(table)


# -- splice on a hand-built trees artifact --------------------------------------------------------


def grow(parent: Node, text: str, ids: list[int], *, cut: bool = False) -> Node:
    """A child of ``parent`` stepped for real (the stage's own step: restore, step, snapshot);
    ``cut``: a dead end at this depth (terminal, reward 0), backed up like the search does."""
    node = parent.tree.add(parent, Child(text, ids, [-0.5] * len(ids)))
    outcome = stages.mcts._step(node)
    settle(node, outcome, max_depth=node.depth if cut else 10)
    if node.terminal:
        backup(node, node.reward)
    return node


def hand_built_tree(suite, task) -> tuple[Tree, dict[str, Node]]:
    """root -> a (get the first ingredient) -> b (craft too early: an env error) -> b2 (cut)
                                            -> the rest of the expert's plan -> success
    -> c (not an action: invalid, cut)"""
    expert = suite.expert(task)
    tree = stages.mcts.plant(suite, task, seed=5)
    a = grow(tree.root, expert[0], [11, 2])
    b = grow(a, expert[-1], [12, 2])  # the final craft before its other ingredients
    b2 = grow(b, "inventory", [13, 2], cut=True)
    node, good = a, []
    for k, action in enumerate(expert[1:]):
        node = grow(node, action, [20 + k, 2])
        good.append(node)
    c = grow(tree.root, "hello there", [14, 2], cut=True)
    return tree, {"a": a, "b": b, "b2": b2, "c": c, "goal": good[-1]}


@pytest.fixture
def spliced_inputs(boot, tmp_path):
    """A trees artifact holding one hand-built tree of a train task with two ingredients."""
    _, cfg, store, refs = boot
    suite = make_suite(cfg.envs[0])
    task = next(
        t
        for t in load_tasks(store, refs["train"], env="craft", split="train")
        if len(suite.expert(t)) >= 3 and t.difficulty == 1
    )
    tree, nodes = hand_built_tree(suite, task)
    # each child was stepped from its parent's restored state, whatever was stepped before it
    for node in tree.nodes[1:]:
        assert node.observation == replayed_observation(suite, task, node)
    assert nodes["b"].info["error"] and nodes["c"].info["invalid"]
    assert nodes["goal"].success and tree.root.value == pytest.approx(1 / 3)
    w: ArtifactWriter = store.writer(
        "trees", stage="mcts", round=1, config={"hand_built": str(tmp_path)},
        inputs=[refs["init"].id, refs["train"].id],
    )  # fmt: skip
    w.write_shard(0, to_rows(tree))
    return cfg, store, refs, w.commit(), task, nodes


def test_splice_writes_revisions_and_good_paths_with_their_loss_flags(spliced_inputs):
    cfg, store, refs, trees, task, nodes = spliced_inputs
    with contextlib.redirect_stdout(io.StringIO()):
        ref = stages.splice.run(cfg, store, trees, refs["init"], refs["train"], round=1)
    assert ref.kind == "trajectories"
    assert ref.inputs == [trees.id, refs["init"].id, refs["train"].id]
    rows = store.read(ref).to_pylist()
    assert sorted(r["source"] for r in rows) == ["mcts", "revision", "revision"]
    assert all(r["round"] == 1 and r["policy"] == refs["init"].id for r in rows)
    suite = make_suite(cfg.envs[0])
    expert = suite.expert(task)
    by_cut = {r["messages"][3]["content"]: r for r in rows if r["source"] == "revision"}

    # bad path a -> b -> b2 against the sibling good path a -> ...: cut at b (the env error),
    # resumed at a's other child
    after_b = by_cut[expert[0]]
    msgs = after_b["messages"]
    assert [m["loss"] for m in msgs[:7]] == [False] * 7  # opening, a, obs, b, obs
    assert msgs[5]["content"] == expert[-1] and msgs[6]["content"] == nodes["b"].observation
    revision, answer = msgs[7], msgs[8]
    assert revision["role"] == "assistant" and revision["loss"]
    assert revision["content"].startswith("Thought: ")
    assert revision["content"].endswith("\nAction: inventory")
    # the env's real answer to the no-op in the state after b (b failed: what a got)
    assert answer["role"] == "user" and not answer["loss"]
    assert answer["content"].startswith("Inventory: ") and answer["content"] != "Inventory: empty."
    env = suite.make()
    env.reset(task)
    env.step(expert[0])
    env.step(expert[-1])
    assert answer["content"] == env.step(revision["content"])[0]
    continuation = [m for m in msgs[9:] if m["role"] == "assistant"]
    assert [m["content"] for m in continuation] == expert[1:]
    assert all(m["loss"] for m in continuation)
    assert after_b["turn_token_ids"] == [[20 + k, 2] for k in range(len(expert) - 1)]
    assert after_b["success"] and after_b["reward"] == 1.0 and after_b["finish_reason"] == "done"

    # bad path c (invalid at the first step) against the good path from the root
    after_c = by_cut["hello there"]
    assert (
        after_c["messages"][4]["content"]
        == "Invalid action. Use: get N ITEM, craft ITEM using N ITEM, N ITEM, or inventory."
    )
    assert after_c["messages"][6]["content"] == "Inventory: empty."
    assert [m["content"] for m in after_c["messages"][7:] if m["role"] == "assistant"] == expert
    assert after_c["invalid_actions"] == 1

    (good,) = [r for r in rows if r["source"] == "mcts"]
    trained = [m["loss"] for m in good["messages"] if m["role"] == "assistant"]
    assert trained == [False] + [True] * len(expert)  # Ok. is not trained
    assert good["success"] and len(good["turn_token_ids"]) == len(expert)

    assert ref.summary["craft/revisions"] == 2 and ref.summary["craft/revisions_per_tree"] == 2
    assert ref.summary["craft/good_paths"] == 1 and ref.summary["craft/trees_revised"] == 1

    # round sft trains on every row: revision turns and continuations, good paths
    from flywheel.checkpoint import load_policy
    from stages.sft import examples_from

    _, tokenizer = load_policy(store, refs["init"])
    examples = examples_from(store, [ref], tokenizer)
    assert len(examples) == 3
    for example in examples:
        assert sum(example["loss_mask"]) > 2 * (len(expert) - 1)


def test_splice_by_the_policy_as_judge(spliced_inputs):
    cfg, store, refs, trees, _, _ = spliced_inputs
    cfg = cfg.model_copy(update={"splice": cfg.splice.model_copy(update={"verifier": "judge"})})
    with contextlib.redirect_stdout(io.StringIO()):
        ref = stages.splice.run(cfg, store, trees, refs["init"], refs["train"], round=1)
    # one verdict per distinct step of the bad paths: a, b, b2 and c
    assert ref.summary["craft/judged_steps"] == 4
    assert 0 <= ref.summary["craft/bad_steps"] <= 4
    rows = store.read(ref).to_pylist()
    assert sorted(r["source"] for r in rows) == ["mcts", "revision", "revision"]
    rule = stages.splice.artifact_config(load_config(None, []))
    assert "engine" not in rule and "engine" in stages.splice.artifact_config(cfg)


def test_splice_refuses_an_env_without_a_noop(spliced_inputs):
    cfg, store, refs, trees, _, _ = spliced_inputs
    suite = "tests.conftest:ArithWithoutNoop"
    silent = cfg.model_copy(update={"envs": [cfg.envs[0].model_copy(update={"suite": suite})]})
    with pytest.raises(ValueError, match="splice: env craft names no no-op action"):
        stages.splice.run(silent, store, trees, refs["init"], refs["train"], round=1)


def test_splice_opens_revision_turns_with_the_configured_thoughts(spliced_inputs):
    """splice.thoughts: every revision turn opens with one of them; the id changes only when
    they are set, and a thought the policy's tokenizer cannot spell is refused in one line,
    before anything is written."""
    cfg, store, refs, trees, _, _ = spliced_inputs
    one = "My last action was wrong."
    short = cfg.model_copy(update={"splice": cfg.splice.model_copy(update={"thoughts": [one]})})
    with contextlib.redirect_stdout(io.StringIO()):
        ref = stages.splice.run(short, store, trees, refs["init"], refs["train"], round=1)
        default = stages.splice.run(cfg, store, trees, refs["init"], refs["train"], round=1)
    assert ref.id != default.id
    revisions = [r for r in store.read(ref).to_pylist() if r["source"] == "revision"]
    turns = [
        m["content"] for r in revisions for m in r["messages"] if m["content"].startswith("Thought")
    ]
    assert turns == [f"Thought: {one}\nAction: inventory"] * 2
    assert "thoughts" not in stages.splice.artifact_config(cfg)["splice"]
    assert stages.splice.artifact_config(short)["splice"]["thoughts"] == [one]

    odd = short.model_copy(
        update={
            "splice": short.splice.model_copy(update={"thoughts": [one, "Zyzzyva went wrong."]})
        }
    )
    before = store.list(round=1, stage="splice")
    with pytest.raises(ValueError, match="cannot spell 'Zyzzyva'") as err:
        stages.splice.run(odd, store, trees, refs["init"], refs["train"], round=1)
    assert "\n" not in str(err.value)
    assert store.list(round=1, stage="splice") == before  # nothing written


def test_splice_without_revisions_writes_the_good_paths_alone(spliced_inputs):
    """splice.revisions=false: the same tree gives its good path and no revision, and an env
    that names no no-op action is then accepted (no revision turn is ever taken)."""
    cfg, store, refs, trees, task, _ = spliced_inputs
    suite = "tests.conftest:ArithWithoutNoop"
    off = cfg.model_copy(
        update={
            "splice": cfg.splice.model_copy(update={"revisions": False}),
            "envs": [cfg.envs[0].model_copy(update={"suite": suite})],
        }
    )
    stages.splice.check_envs(off)  # no no-op needed
    with contextlib.redirect_stdout(io.StringIO()):
        ref = stages.splice.run(off, store, trees, refs["init"], refs["train"], round=1)
    rows = store.read(ref).to_pylist()
    assert [r["source"] for r in rows] == ["mcts"]
    assert rows[0]["success"] and rows[0]["task_id"] == task.task_id
    assert ref.summary["craft/revisions"] == 0 and ref.summary["craft/good_paths"] == 1
    # hashed only when off: the default's id is the one from before the field
    assert "revisions" not in stages.splice.artifact_config(cfg)["splice"]
    assert stages.splice.artifact_config(off)["splice"]["revisions"] is False
    # the bootstrap's tokenizer learns revision turns only for rounds that write them
    assert stages.init._revises(cfg) and not stages.init._revises(off)


def test_mcts_searches_only_the_tasks_no_explored_sample_solved(boot):
    """mcts.tasks=unsolved: a tree for each explored task without a successful sample, in the
    train split's order, at most mcts.n_tasks of them; the explore artifact is an input."""
    overrides, _, store, refs = boot
    cfg = load_config(
        None, [*overrides, "iteration.data=[explore, mcts]", "mcts.tasks=unsolved",
               "mcts.n_tasks=3"],
    )  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        train, val, _ = stages.tasks.run(cfg, store)
        expert = stages.expert.run(cfg, store, train, val)
    # an explore artifact by hand: two samples of each of the first 8 train tasks, the
    # demonstration's row twice; tasks 0, 3 and 5 solved by one sample, the rest by none
    order = [t.task_id for t in load_tasks(store, train, env="craft", split="train")]
    demo = {r["task_id"]: r for r in store.read(expert).to_pylist() if r["split"] == "train"}
    rows = []
    for i, task_id in enumerate(order[:8]):
        for k in range(2):
            ok = i in (0, 3, 5) and k == 1
            rows.append({**demo[task_id], "source": "explore", "sample_idx": k, "success": ok,
                         "reward": float(ok), "round": 1, "policy": refs["init"].id})  # fmt: skip
    w = store.writer("trajectories", stage="explore", round=1, config={"hand_built": 1},
                     inputs=[refs["init"].id, train.id])  # fmt: skip
    w.write_shard(0, rows)
    explored = w.commit()
    with contextlib.redirect_stdout(io.StringIO()) as out:
        ref = stages.mcts.run(cfg, store, refs["init"], train, round=1, explored=explored)
    trees = trees_from_rows(store.read(ref).to_pylist())
    assert [t.task_id for t in trees] == [order[1], order[2], order[4]]
    assert ref.inputs == [refs["init"].id, train.id, explored.id]
    said = "mcts: craft: 3 of the 5 tasks no explored sample solved (of 8 explored)"
    assert said in out.getvalue()
    # the window search's id hashes no `tasks` (ids from before the field); unsolved's does
    window = load_config(None, overrides)
    assert "tasks" not in stages.mcts.artifact_config(window, 1)["mcts"]
    assert stages.mcts.artifact_config(cfg, 1)["mcts"]["tasks"] == "unsolved"
    with pytest.raises(ValueError, match="mcts.tasks=unsolved needs the round's explore artifact"):
        stages.mcts.run(cfg, store, refs["init"], train, round=1)


def test_splice_on_arith_cuts_where_a_wrong_call_parts_from_the_good_path():
    """arith's steps flag no wrong number, so the rule verifier finds no error and the cut is the
    first call where the bad path leaves the good one; the revision turn takes arith's no-op,
    which the env answers without changing the episode."""
    from flywheel.envs.arith import NOOP, ArithSuite, parse_action

    suite = ArithSuite(max_value=99)
    task = next(t for t in suite.tasks("train", 50, seed=3) if t.difficulty == 2)
    expert = suite.expert(task)  # two calls, then the answer
    first = task.meta["steps"][0]
    wrong_call = f"<python>print({first['result']} + 1)</python>"
    assert wrong_call != expert[1]

    tree = stages.mcts.plant(suite, task, seed=1)
    try:
        a = grow(tree.root, expert[0], [11, 2])
        bad = grow(a, wrong_call, [12, 2])
        bad_end = grow(bad, "<answer>0</answer>", [13, 2])
        good = grow(a, expert[1], [14, 2])
        goal = grow(good, expert[2], [15, 2])
    finally:
        tree.state.env.close()
    assert goal.success and not bad_end.success and not any(bad.info.get(k) for k in RULE_KEYS)

    rows = stages.splice.tree_rows(tree, suite, task, 0.5, 0.2, None)
    assert sorted(r["source"] for r in rows) == ["mcts", "revision"]
    (revised,) = [r for r in rows if r["source"] == "revision"]
    msgs = revised["messages"][3:]  # after the opening (instruction, Ok., the story)
    assert [(m["role"], m["content"], m["loss"]) for m in msgs[:4]] == [
        ("assistant", expert[0], False), ("user", a.observation, False),
        ("assistant", wrong_call, False), ("user", bad.observation, False),
    ]  # fmt: skip
    revision, answer = msgs[4], msgs[5]
    assert revision["loss"] and revision["content"].endswith(f"\nAction: {NOOP}")
    assert parse_action(revision["content"]) == ("python", "print()")
    assert answer == {"role": "user", "content": "(no output)", "loss": False}
    assert [(m["content"], m["loss"]) for m in msgs[6:] if m["role"] == "assistant"] == [
        (expert[1], True), (expert[2], True),
    ]  # fmt: skip
    assert revised["success"] and revised["turn_token_ids"] == [[14, 2], [15, 2]]

    # the no-op leaves the episode where it was: the rest of the expert's plan still succeeds
    env = suite.make()
    env.reset(task)
    env.step(expert[0])
    assert env.step(NOOP)[0] == "(no output)"
    assert [env.step(action)[1] for action in expert[1:]] == [0.0, 1.0]
    env.close()


def test_the_tokenizer_learns_the_revision_turns_of_each_envs_noop(tmp_path):
    """With mcts in the round, init's tokenizer learns splice's revision turns as each env writes
    them (arith's end with its no-op tool call), and the init id names those no-ops."""
    from flywheel.checkpoint import load_policy
    from flywheel.envs.arith import NOOP
    from flywheel.splice import REVISION_THOUGHTS, revision_turn

    mcts = ["iteration.data=[explore,mcts]", "iteration.steps=[sft]"]
    cfg = load_config(None, tiny_overrides(tmp_path, *mcts))
    assert stages.init.artifact_config(cfg)["revision_noops"] == [NOOP]
    plain = load_config(None, tiny_overrides(tmp_path))
    assert "revision_noops" not in stages.init.artifact_config(plain)
    _, store, refs = bootstrap(tiny_overrides(tmp_path, *mcts))
    _, tokenizer = load_policy(store, refs["init"])
    for thought in REVISION_THOUGHTS:
        ids = tokenizer.encode(revision_turn(thought, NOOP), add_special_tokens=False)
        assert tokenizer.unk_token_id not in ids, thought
    # and no other env's no-op (craft's): the vocabulary is the envs' own
    assert tokenizer.unk_token_id in tokenizer.encode("inventory", add_special_tokens=False)


# -- the round's config shape ---------------------------------------------------------------------


def test_iteration_data_decides_which_stages_run():
    default = load_config(None, [])
    assert default.iteration.data == ["explore"]  # the round as before mcts existed
    cfg = load_config(None, ["iteration.data=[explore, mcts]", "iteration.steps=[sft, dpo]"])
    check_plan(cfg, "mcts", 1)
    check_plan(cfg, "splice", 2)
    check_plan(cfg, "explore", 1)
    with pytest.raises(
        ValueError, match=r"stage mcts does not run with iteration.data=\['explore'\]"
    ):
        check_plan(default, "mcts", 1)
    only = load_config(None, ["iteration.data=[mcts]", "iteration.steps=[sft]"])
    with pytest.raises(
        ValueError, match=r"stage pareto does not run with iteration.data=\['mcts'\]"
    ):
        check_plan(only, "pareto", 1)
    with pytest.raises(ValueError, match="stage mcts does not run in round 0"):
        check_plan(only, "mcts", 0)
    with pytest.raises(ConfigError, match=r"iteration: steps \['dpo'\] train on explore's"):
        load_config(None, ["iteration.data=[mcts]", "iteration.steps=[sft, dpo]"])
    with pytest.raises(ConfigError, match="baselines: rft trains on the rounds' explore data"):
        load_config(None, ["iteration.data=[mcts]", "iteration.steps=[sft]", "baselines=[rft]"])
    with pytest.raises(ConfigError, match="iteration: data must not repeat"):
        load_config(None, ["iteration.data=[mcts, mcts]"])
    with pytest.raises(ConfigError, match="mcts.tasks=unsolved searches the tasks explore did"):
        load_config(None, ["iteration.data=[mcts]", "iteration.steps=[sft]", "baselines=[]",
                           "mcts.tasks=unsolved"])  # fmt: skip
    with pytest.raises(ConfigError, match="leave splice nothing to write"):
        load_config(None, ["splice.revisions=false", "splice.good_paths=false"])


# -- recovery in evaluate -------------------------------------------------------------------------


def test_recovery_counts_failed_actions_by_replay(boot):
    _, cfg, store, refs = boot
    suite = make_suite(cfg.envs[0])
    test = load_tasks(store, refs["test"], env="craft", split="test")
    opening = [
        {"role": "user", "content": suite.instruction},
        {"role": "assistant", "content": "Ok."},
    ]

    def episode(task, turns):
        msgs = [*opening, {"role": "user", "content": task.prompt}]
        for turn in turns:
            msgs += [{"role": "assistant", "content": turn}, {"role": "user", "content": "..."}]
        return msgs

    recovered = ["inventory please", "get 99 nothing", *suite.expert(test[0])]  # 2 failed, solved
    infos = stages.evaluate.replay_infos(suite, test[0], episode(test[0], recovered))
    assert stages.evaluate.count_failed(infos) == 2 and infos[-1]["success"]
    assert (
        stages.evaluate.count_failed(
            stages.evaluate.replay_infos(suite, test[1], episode(test[1], suite.expert(test[1])))
        )
        == 0
    )
    frame = pl.DataFrame(
        {"env": ["craft"] * 4, "task_id": ["a", "b", "c", "d"],
         "success": [True, False, True, False], "reward": [1.0, 0, 1, 0], "steps": [3] * 4,
         "tool_calls": [0] * 4, "tool_ok": [0] * 4, "tokens": [9] * 4,
         "failed_actions": [2, 1, 0, 0]}
    )  # fmt: skip
    metrics = summarize(frame)["craft"]
    assert metrics["failed_episodes"] == 2 and metrics["recovery_rate"] == 0.5
    assert "recovery_rate" not in summarize(frame.drop("failed_actions"))["craft"]


@pytest.mark.slow  # a tiny flywheel round through the flow
def test_the_round_hands_its_exploration_to_an_unsolved_search(tmp_path):
    """The flow passes the round's explore artifact to mcts with tasks=unsolved: the trees are
    searched on the explored tasks no sample solved, and the splice writes good paths only."""
    from flows.flywheel import _plan, _walk

    overrides = tiny_overrides(
        tmp_path, "iteration.data=[explore, mcts]", "iteration.steps=[sft]", "baselines=[]",
        "mcts.tasks=unsolved", "splice.revisions=false", "mcts.iterations=2", "mcts.n_gen=2",
        "mcts.max_depth=3",
    )  # fmt: skip
    plan = _plan(None, overrides)
    with contextlib.redirect_stdout(io.StringIO()):
        _walk(plan, rounds=1)
    store = plan.store
    (explore,) = store.list(round=1, stage="explore")
    (trees,) = store.list(round=1, stage="mcts")
    (spliced,) = store.list(round=1, stage="splice")
    assert trees.inputs[-1] == explore.id
    rows = store.read(explore, columns=["task_id", "success"]).to_pylist()
    unsolved = {r["task_id"] for r in rows} - {r["task_id"] for r in rows if r["success"]}
    searched = {r["task_id"] for r in store.read(trees, columns=["task_id"]).to_pylist()}
    assert searched == unsolved
    assert all(r["source"] == "mcts" for r in store.read(spliced).to_pylist())
