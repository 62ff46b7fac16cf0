"""stages.reflect on the craft env: a hand-built explore artifact (failed trajectories played
through real envs, a success and an env error that are not reflected on) reflected on with a
scripted policy that plays the expert's plan after the hint; the rows kept, their loss flags,
the summary, sft reading them; a rerun after a crash keeps the finished shards and their counts;
the embedded tokenizer learns the hints only when reflect runs; the round's config shape."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

import stages.expert
import stages.init
import stages.reflect
import stages.tasks
from flows.flywheel import check_plan
from flywheel.checkpoint import load_policy
from flywheel.config import ConfigError, load_config
from flywheel.envs import make_suite
from flywheel.store import Store
from stages._common import load_tasks
from tests.conftest import tiny_overrides
from tests.flywheel.test_reflect import BAD, HINT, PlanEngine, trajectory

CRAFT = (
    "{name: craft, n_train: 12, n_val: 4, n_test: 4, max_steps: 4, options: "
    "{depth_weights: [1, 0, 0, 0], min_distractors: 0, max_distractors: 0, max_count: 1}}"
)


def prepare(root: Path, *extra: str):
    overrides = tiny_overrides(
        root, f"envs=[{CRAFT}]", "iteration.data=[explore,reflect]", "iteration.steps=[sft]",
        "baselines=[]", *extra,
    )  # fmt: skip
    cfg = load_config(None, overrides)
    store = Store(cfg.run.store_root(), cfg.run.name)
    with contextlib.redirect_stdout(io.StringIO()):
        train, val, _ = stages.tasks.run(cfg, store)
        init = stages.init.run(cfg, store, stages.expert.run(cfg, store, train, val), train)
    _, tokenizer = load_policy(store, init)
    tasks = load_tasks(store, train, env="craft", split="train")
    suite = make_suite(cfg.envs[0])
    rows = []
    for i, task in enumerate(tasks[:5]):
        plan = suite.expert(task)
        turns = plan if i == 0 else [plan[0], BAD] if i % 2 else [BAD, BAD, BAD]
        row = trajectory(tokenizer, task, turns)
        rows.append({**row, "round": 1, "policy": init.id, "source": "explore"})
    assert rows[0]["success"] and not any(r["success"] for r in rows[1:])
    rows[4]["finish_reason"] = "error"  # an env that broke: not reflected on
    w = store.writer("trajectories", stage="explore", round=1, config={"hand_built": True},
                     inputs=[init.id, train.id])  # fmt: skip
    w.write_shard(0, rows)
    explored = w.commit()
    return cfg, store, {"train": train, "init": init, "explored": explored}, tokenizer, tasks


@pytest.fixture(scope="module")
def boot(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("reflect"))


def with_engine(monkeypatch, engine):
    @contextlib.contextmanager
    def setup(cfg, *args, **kw):
        assert kw["needs_logprobs"] and kw["label"] == "reflect"
        yield engine, {e.name: e.max_steps for e in cfg.envs}, []

    monkeypatch.setattr(stages.reflect, "rollout_setup", setup)


def run(cfg, store, refs):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ref = stages.reflect.run(cfg, store, refs["explored"], refs["init"], refs["train"], round=1)
    return ref, out.getvalue()


def test_reflect_keeps_hinted_continuations_that_succeed(boot, monkeypatch):
    cfg, store, refs, tokenizer, tasks = boot
    with_engine(monkeypatch, PlanEngine(tokenizer, tasks))
    ref, printed = run(cfg, store, refs)
    assert ref.kind == "trajectories"
    assert ref.inputs == [refs["explored"].id, refs["init"].id, refs["train"].id]
    assert "reflect: craft: 3 of 3 failed trajectories recovered in 3 attempts" in printed
    assert ref.summary == {"craft/reflected": 3.0, "craft/attempts": 3.0, "craft/successes": 3.0,
                           "craft/skipped": 0.0, "craft/recovered_share": 1.0}  # fmt: skip
    rows = store.read(ref).to_pylist()
    assert [r["task_id"] for r in rows] == [t.task_id for t in tasks[1:4]]
    hint_ids = tokenizer.encode(HINT, add_special_tokens=False)
    assert tokenizer.unk_token_id not in hint_ids  # init learned the hint's words
    for row in rows:
        assert row["source"] == "revision" and row["round"] == 1 and row["success"]
        assert row["policy"] == refs["init"].id and row["finish_reason"] == "done"
        hinted = next(i for i, m in enumerate(row["messages"]) if m["content"].startswith(HINT))
        assert not any(m["loss"] for m in row["messages"][:hinted])
        assert all(m["loss"] for m in row["messages"][hinted:] if m["role"] == "assistant")
        k = sum(m["role"] == "assistant" for m in row["messages"][3:hinted])
        assert row["turn_token_ids"][k][: len(hint_ids)] == hint_ids
        assert row["turn_logprobs"][k][: len(hint_ids)] == [0.0] * len(hint_ids)

    # round sft trains on them: the hint's ids are trained, the flawed prefix is not
    from stages.sft import examples_from

    examples = examples_from(store, [ref], tokenizer)
    assert len(examples) == 3
    for example, row in zip(examples, rows, strict=True):
        hinted = next(i for i, m in enumerate(row["messages"]) if m["content"].startswith(HINT))
        k = sum(m["role"] == "assistant" for m in row["messages"][3:hinted])
        assert k >= 1 and sum(example["loss_mask"]) == sum(map(len, row["turn_token_ids"][k:]))

    # a second run is a cache hit: no engine
    with_engine(monkeypatch, None)
    again, _ = run(cfg, store, refs)
    assert again.id == ref.id


class Crashing(PlanEngine):
    """Plays like PlanEngine until a chat of ``task_id``'s prompt comes: then the process
    'dies' (an exception the stage does not catch)."""

    def __init__(self, tokenizer, tasks, prompt: str) -> None:
        super().__init__(tokenizer, tasks)
        self.prompt = prompt

    def generate(self, chats, params):
        if any(c.messages[2]["content"] == self.prompt for c in chats):
            raise KeyboardInterrupt("killed")
        return super().generate(chats, params)


def test_a_rerun_after_a_crash_keeps_the_finished_shards(tmp_path, monkeypatch):
    cfg, store, refs, tokenizer, tasks = prepare(tmp_path, "reflect.shard_size=1")
    with_engine(monkeypatch, Crashing(tokenizer, tasks, tasks[2].prompt))
    with pytest.raises(KeyboardInterrupt):
        run(cfg, store, refs)
    (tmp,) = (Path(cfg.run.store_root()) / cfg.run.name / "round-1" / "reflect").glob(".tmp-*")
    (kept,) = tmp.glob("part-*.parquet")
    assert kept.name == "part-00000.parquet"
    stat = kept.stat()

    engine = PlanEngine(tokenizer, tasks)
    with_engine(monkeypatch, engine)
    ref, printed = run(cfg, store, refs)
    assert "reflect: resuming, 1/3 shards already written" in printed
    assert printed.count("reflect: shard ") == 2
    final = Path(ref.path) / kept.name
    assert (final.stat().st_ino, final.stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)
    # the kept shard's counts come from its footer
    assert ref.summary["craft/reflected"] == 3 and ref.summary["craft/successes"] == 3
    assert ref.manifest["rows"] == 3 and len(ref.manifest["shards"]) == 3


def test_the_tokenizer_learns_the_hints_only_when_reflect_runs(boot, tmp_path):
    cfg = boot[0]
    assert stages.init.artifact_config(cfg)["hints"] == {"craft": [HINT]}
    plain = load_config(None, tiny_overrides(tmp_path, f"envs=[{CRAFT}]"))
    assert "hints" not in stages.init.artifact_config(plain)
    store = Store(plain.run.store_root(), plain.run.name)
    with contextlib.redirect_stdout(io.StringIO()):
        train, val, _ = stages.tasks.run(plain, store)
        init = stages.init.run(plain, store, stages.expert.run(plain, store, train, val), train)
    _, tokenizer = load_policy(store, init)
    with pytest.raises(ValueError, match="reflect: the policy's tokenizer cannot spell the hint"):
        stages.reflect._encoder(tokenizer)(HINT)


def test_reflect_needs_explore_in_the_round():
    with pytest.raises(
        ConfigError, match=r"iteration: reflect in data reflects on explore's failed trajectories"
    ):
        load_config(None, ["iteration.data=[reflect]", "iteration.steps=[sft]"])
    with pytest.raises(ConfigError, match="iteration: reflect in data"):
        load_config(None, ["iteration.data=[mcts, reflect]", "iteration.steps=[sft]"])
    cfg = load_config(None, ["iteration.data=[explore, reflect]", "iteration.steps=[sft]"])
    check_plan(cfg, "reflect", 1)
    with pytest.raises(ValueError, match=r"stage reflect does not run with iteration.data"):
        check_plan(load_config(None, []), "reflect", 1)
    with pytest.raises(ValueError, match="stage reflect does not run in round 0"):
        check_plan(cfg, "reflect", 0)
    assert cfg.reflect.max_evolve_times == 3
