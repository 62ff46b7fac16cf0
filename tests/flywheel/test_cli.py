"""``flywheel`` through ``flywheel.cli.main``: every error is one line on stderr starting with
``flywheel: error:`` and a non-zero exit, and a failed command leaves nothing half-written; plus
the read-only commands (artifacts ls / show / lineage, config --fields) on a real small store."""

from __future__ import annotations

from pathlib import Path

import pytest

import stages.expert
import stages.tasks
from flywheel.cli import main
from flywheel.config import load_config
from flywheel.store import Store
from tests.conftest import write_tiny_yaml


@pytest.fixture
def small_store(tmp_path):
    """tasks and expert artifacts of the tiny config, and its YAML file."""
    path = write_tiny_yaml(tmp_path)
    cfg = load_config(path)
    store = Store(cfg.run.store_root(), cfg.run.name)
    tasks, val, test = stages.tasks.run(cfg, store)
    expert = stages.expert.run(cfg, store, tasks, val)
    return path, store, (tasks, val, test), expert


def folders(root: Path) -> set[str]:
    """Every file and folder under the store (a failed command must add none)."""
    return {str(p.relative_to(root)) for p in root.rglob("*")} if root.exists() else set()


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, *needles: str) -> str:
    assert rc != 0
    lines = err.splitlines()
    assert len(lines) == 1, f"stderr is not one line:\n{err}"
    assert lines[0].startswith("flywheel: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


# -- config errors -------------------------------------------------------------------------------


def test_unknown_override_key_is_one_line_and_starts_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/default.yaml here: the built-in defaults
    before = folders(tmp_path)
    rc, out, err = run_cli(capsys, "run", "nope.x=1")
    assert_one_line_error(rc, err, "unknown key nope")
    assert out == ""
    assert folders(tmp_path) == before  # no work/ folder, no store, no Prefect database


def test_overrides_may_follow_options():
    from flywheel.cli import _parse

    args = _parse(["stage", "grpo", "--round", "1", "grpo.lr=1e-3", "run.seed=-1"])
    assert (args.name, args.round, args.overrides) == ("grpo", 1, ["grpo.lr=1e-3", "run.seed=-1"])
    args = _parse(["run", "a.b=1", "--rounds", "2", "c.d=2"])
    assert (args.rounds, args.overrides) == (2, ["a.b=1", "c.d=2"])
    with pytest.raises(SystemExit):
        _parse(["stage", "grpo", "--round", "1", "--nope"])
    args = _parse(["report", "--json", "run.name=other"])
    assert args.json and args.overrides == ["run.name=other"]
    with pytest.raises(SystemExit):
        _parse(["report", "--json", "--nope"])


def test_unknown_key_in_yaml_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  rounds: 1\nsft:\n  lrr: 0.1\n")
    for argv in (
        ["run", "--config", str(bad)],
        ["stage", "sft", "--round", "0", "--config", str(bad)],
        ["config", "--config", str(bad)],
        ["report", "--config", str(bad)],
    ):
        rc, _, err = run_cli(capsys, *argv)
        assert_one_line_error(rc, err, "unknown key sft.lrr")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def test_bad_value_and_missing_file(tmp_path, capsys):
    rc, _, err = run_cli(capsys, "config", "sft.lr=-1")
    assert_one_line_error(rc, err, "sft.lr")
    rc, _, err = run_cli(capsys, "config", "--config", str(tmp_path / "none.yaml"))
    assert_one_line_error(rc, err, "no such file")
    broken = tmp_path / "broken.yaml"
    broken.write_text("run: [unclosed\n")
    rc, _, err = run_cli(capsys, "config", "--config", str(broken))
    assert_one_line_error(rc, err, "not valid YAML")


def test_a_round_that_splices_an_env_without_a_noop_fails_before_any_work(tmp_path, capsys):
    """An env with no no-op action for a revision turn: with mcts in iteration.data the run stops
    at once (not after the bootstrap and the search) and writes nothing; a walk that stops
    before splice (the bootstrap, or round 1's mcts) is not refused."""
    path = write_tiny_yaml(tmp_path, "envs.0.suite=tests.conftest:ArithWithoutNoop")
    cfg = load_config(path)
    mcts = ["iteration.data=[explore,mcts]", "iteration.steps=[sft]"]
    rc, _, err = run_cli(capsys, "run", "--config", str(path), *mcts)
    assert_one_line_error(rc, err, "splice: env arith names no no-op action", "e.g. craft")
    assert folders(Path(cfg.run.store_root())) == set()
    rc, _, err = run_cli(capsys, "stage", "splice", "--round", "1", "--config", str(path), *mcts)
    assert_one_line_error(rc, err, "splice: env arith names no no-op action")
    assert folders(Path(cfg.run.store_root())) == set()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.yaml"]  # no work folder either
    from flows.flywheel import splices

    with_mcts = load_config(path, mcts)
    assert splices(with_mcts, 2) and not splices(with_mcts, 0)
    for stop, reached in [(("sft", 0), False), (("mcts", 1), False), (("splice", 1), True),
                          (("explore", 2), True), (("evaluate", 1), True)]:  # fmt: skip
        assert splices(with_mcts, stop[1], stop_at=stop) is reached, stop
    assert not splices(cfg, 2)  # no mcts in iteration.data: nothing splices


def test_a_revision_thought_the_tokenizer_cannot_spell_fails_before_any_work(tmp_path, capsys):
    """splice.thoughts with a word the embedded tokenizer lacks: the run stops at once, in one
    line naming the word, and writes nothing; the published thoughts' words pass."""
    path = write_tiny_yaml(tmp_path)
    cfg = load_config(path)
    mcts = ["iteration.data=[explore,mcts]", "iteration.steps=[sft]"]
    rc, _, err = run_cli(capsys, "run", "--config", str(path), *mcts,
                         "splice.thoughts=[Zyzzyva went wrong.]")  # fmt: skip
    assert_one_line_error(rc, err, "splice.thoughts", "cannot spell 'Zyzzyva'")
    assert folders(Path(cfg.run.store_root())) == set()
    from flows.flywheel import check_run

    check_run(load_config(path, [*mcts, "splice.thoughts=[My last action was wrong.]"]), 2)
    # without revisions no thought is written, so none is checked
    check_run(load_config(path, [*mcts, "splice.revisions=false",
                                 "splice.thoughts=[Zyzzyva went wrong.]"]), 2)  # fmt: skip
