"""The Prefect flows in-process on the tiny config: the first ``flywheel_flow`` runs every stage,
a second one is all cache hits and fast, a changed stage config reruns that stage and what
follows only, ``stage_flow(..., force=True)`` writes one new version and stops, and
``flywheel report --json`` reads the evaluations back."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from flows.flywheel import stage_flow
from flywheel.cli import main
from flywheel.config import BASELINES, load_config
from flywheel.report import format_table
from flywheel.store import Store
from tests.conftest import run_flywheel, stage_lines, tiny_overrides, write_tiny_yaml
from tests.flywheel.test_tracking import runs_by_id

BOOTSTRAP = ["tasks", "tasks", "tasks", "expert", "init", "evaluate", "sft", "evaluate"]
BASELINE_LINES = ["sft_more", "evaluate", "rft", "evaluate"]

pytestmark = pytest.mark.slow


def manifests(root: Path) -> set[str]:
    return {str(p.parent.relative_to(root)) for p in (root / "store").rglob("manifest.json")}


def test_first_run_runs_every_stage(tiny_flywheel):
    lines = tiny_flywheel.lines
    assert [stage for r, stage, _, _ in lines if r == 0] == BOOTSTRAP
    round1 = [stage for r, stage, _, _ in lines if r == 1]
    assert round1[0] == "explore" and round1[-len(BASELINE_LINES) :] == BASELINE_LINES
    assert round1[-len(BASELINE_LINES) - 1] == "evaluate"
    cfg = load_config(None, tiny_flywheel.overrides)
    steps = cfg.iteration.steps
    assert set(steps) <= set(round1), f"round 1 ran {round1}, configured steps {steps}"
    assert {r for r, *_ in lines} == {0, 1}
    # the run says which config it read: here no file, the built-in defaults and the overrides
    said = [line for line in tiny_flywheel.printed.splitlines() if line.startswith("config: ")]
    assert said == [
        "config: the built-in defaults (no config file) with " + " ".join(tiny_flywheel.overrides)
    ]
    assert not [line for line in lines if line[2]], "a stage was a cache hit on the first run"
    # every artifact in the store was announced, and every announced one is in the store
    assert tiny_flywheel.artifacts == {art_id for *_, art_id in lines}
    assert len({art_id for *_, art_id in lines}) == len(lines)


def test_second_run_is_all_cache_hits_and_fast(tiny_flywheel):
    before = manifests(tiny_flywheel.root)
    printed, seconds, rows = run_flywheel(tiny_flywheel.overrides, rounds=1)
    lines = stage_lines(printed)
    assert [(r, s, a) for r, s, _, a in lines] == [(r, s, a) for r, s, _, a in tiny_flywheel.lines]
    assert all(hit for _, _, hit, _ in lines), printed
    assert manifests(tiny_flywheel.root) == before
    assert seconds < tiny_flywheel.seconds / 2, (seconds, tiny_flywheel.seconds)
    assert rows == tiny_flywheel.report


def owners(lines: list[tuple[int, str, bool, str]]) -> list[str]:
    """Each progress line's stage, an evaluate line named after the policy stage it evaluates."""
    out: list[str] = []
    for _, stage, _, _ in lines:
        out.append(out[-1] if stage == "evaluate" and out else stage)
    return out


ROUND_STAGES = {"explore", "pareto", "dpo", "sft_more", "rft"}


@pytest.mark.parametrize(
    ("override", "reruns"),
    [
        ("evaluate.temperature=0.5", "evaluate"),
        ("sft.lr=0.001", {"sft"} | ROUND_STAGES),
        ("dpo.beta=[0.2]", {"dpo", "sft_more"}),  # sft_more matches the rounds' compute
        ("sft_more.lr=0.001", {"sft_more"}),
        ("rft.per_task=2", {"rft"}),
        ("rft.seed=3", {"rft"}),  # a baseline retrained alone with another data order
    ],
    ids=["evaluate", "sft", "dpo-beta", "sft_more", "rft", "rft-seed"],
)
def test_changed_config_reruns_that_stage_and_what_follows(tiny_flywheel, override, reruns):
    before = manifests(tiny_flywheel.root)
    printed, _, _ = run_flywheel([*tiny_flywheel.overrides, override], rounds=1)
    lines = stage_lines(printed)
    assert [(r, s) for r, s, _, _ in lines] == [(r, s) for r, s, _, _ in tiny_flywheel.lines]
    if reruns == "evaluate":  # evaluate's config feeds no other stage
        assert [hit for _, _, hit, _ in lines] == [s != "evaluate" for _, s, _, _ in lines]
    else:  # the changed stage, what depends on it, and their evaluations: nothing else
        got = [hit for _, _, hit, _ in lines]
        assert got == [o not in reruns for o in owners(lines)], printed
    old = {art_id for *_, art_id in tiny_flywheel.lines}
    new = {art_id for _, _, hit, art_id in lines if not hit}
    assert not new & old
    assert manifests(tiny_flywheel.root) - before == {
        m for m in manifests(tiny_flywheel.root) if m.rsplit("/", 1)[-1] in new
    }


def test_rft_repeats_train_the_next_data_orders_and_the_report_takes_their_mean(tiny_flywheel):
    """rft.repeats=2: the first rft is the run's own (a cache hit), the second trains with the
    next seed and is evaluated; the rounds' gain is measured against the two runs' mean."""
    printed, _, rows = run_flywheel([*tiny_flywheel.overrides, "rft.repeats=2"], rounds=1)
    lines = stage_lines(printed)
    assert [(r, s) for r, s, _, _ in lines] == [
        *[(r, s) for r, s, _, _ in tiny_flywheel.lines], (1, "rft"), (1, "evaluate")
    ]  # fmt: skip
    assert all(hit for _, _, hit, _ in lines[:-2]) and not any(hit for *_, hit, _ in lines[-2:])
    store = Store(str(tiny_flywheel.root / "store"), "tiny")
    first, again = (store.get(i) for r, s, _, i in lines if s == "rft")
    assert again.manifest["config"]["seed"] == first.manifest["config"]["seed"] + 1
    assert again.inputs == first.inputs
    assert [row["policy"] for row in rows].count("rft") == 2
    # Each repeat's row names its data order's seed, in the table as in --json.
    seeds = [row["seed"] for row in rows if row["policy"] == "rft"]
    assert seeds == [first.manifest["config"]["seed"], again.manifest["config"]["seed"]]
    assert f"rft (seed {seeds[1]})" in format_table(rows)
    (round1,) = [row for row in rows if row["round"] == 1 and row["policy"] not in BASELINES]
    g = round1["gain_over_baselines"]
    rft = [row["success_rate"] for row in rows if row["policy"] == "rft"]
    more = [row["success_rate"] for row in rows if row["policy"] == "sft_more"]
    if sum(rft) / 2 > max(more):  # a tie goes to the first of BASELINES, sft_more
        assert g["over"] == "rft (mean of 2)" and g["paired"] is True
        assert g["gain"] == pytest.approx(round1["success_rate"] - sum(rft) / 2)
    else:
        assert g["over"] == "sft_more"


def test_iteration_repeats_train_the_last_round_again_and_the_report_takes_their_mean(
    tiny_flywheel, tmp_path
):
    """iteration.repeats=2 (on a copy of the store): the run's own stages are cache hits
    (repeats changes no id), then the last round's training steps train again from the same
    start policy on the same data with the next training seed, and the new checkpoint is
    evaluated; the report averages the two, and MLflow tells the repeat apart."""
    shutil.copytree(tiny_flywheel.root / "store", tmp_path / "store")
    overrides = [
        *tiny_flywheel.overrides,
        f"run.store={tmp_path / 'store'}",
        f"run.work_dir={tmp_path / 'work'}",
        "iteration.repeats=2",
        "tracking.enabled=true",
    ]
    printed, _, rows = run_flywheel(overrides, rounds=1)
    lines = stage_lines(printed)
    steps = load_config(None, tiny_flywheel.overrides).iteration.steps
    before = [(r, s) for r, s, _, _ in tiny_flywheel.lines]
    assert [(r, s) for r, s, _, _ in lines] == [*before, *[(1, s) for s in steps], (1, "evaluate")]
    assert all(hit for *_, hit, _ in lines[: len(before)])
    assert not any(hit for *_, hit, _ in lines[len(before) :]), printed
    assert "[round 1] repeat 2 of 2: the round's training steps, train seed 1" in printed
    store = Store(str(tmp_path / "store"), "tiny")
    last = steps[-1]
    first, again = (store.get(i) for r, s, _, i in lines if r == 1 and s == last)
    assert again.manifest["config"]["seed"] == first.manifest["config"]["seed"] + 1
    if len(steps) == 1:  # the same start policy and data
        assert again.inputs == first.inputs
    ours = [row for row in rows if row["round"] == 1 and row["policy"] not in BASELINES]
    assert len(ours) == 2 and [row["seed"] for row in ours] == [0, 1]
    mean = ours[0]["repeats"]
    assert mean["of"] == [row["eval_id"] for row in ours]
    assert mean["success_rate"] == pytest.approx(sum(r["success_rate"] for r in ours) / 2)
    assert "gain_over_sft" in mean and "(mean of 2)" in format_table(rows)
    # MLflow: the repeat's stage runs are tagged, and its evaluation is a series of its own.
    cfg = load_config(None, overrides)
    runs = runs_by_id(cfg.tracking_uri(), cfg.tracking.experiment)
    tagged = {r.data.tags["artifact_id"] for r in runs.values() if r.data.tags.get("repeat")}
    assert tagged == {i for *_, i in lines[len(before) :]}
    # A stage rerun stops at its stage: no repeats.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        stage_flow("evaluate", round=1, overrides=overrides)
    assert "repeat 2 of 2" not in out.getvalue()


def test_no_training_or_selection_stage_reads_the_test_split(tiny_flywheel):
    """Walk every artifact's lineage: the test tasks reach evaluate only."""
    store = Store(str(tiny_flywheel.root / "store"), "tiny")
    refs = {ref.id: ref for ref in store.list()}
    test_ids = {
        i for i, ref in refs.items() if ref.stage == "tasks" and ref.manifest["split"] == "test"
    }
    assert len(test_ids) == 1

    def ancestors(art_id: str) -> set[str]:
        found: set[str] = set()
        todo = list(refs[art_id].inputs)
        while todo:
            current = todo.pop()
            if current not in found:
                found.add(current)
                todo.extend(refs[current].inputs)
        return found

    for art_id, ref in refs.items():
        if ref.stage == "evaluate":
            assert test_ids <= set(ref.inputs), art_id  # reporting reads the test split
        else:
            assert not ancestors(art_id) & test_ids, f"{art_id} was made from the test split"
    # and the val split does select checkpoints: the bootstrap SFT validated on it
    sft = next(ref for ref in refs.values() if ref.stage == "sft")
    val_ids = {
        i for i, ref in refs.items() if ref.stage == "tasks" and ref.manifest["split"] == "val"
    }
    assert ancestors(sft.id) & (val_ids | {r.id for r in refs.values() if r.stage == "expert"})


def test_stage_rft_leaves_out_the_last_rounds_training(tiny_flywheel, tmp_path):
    """``stage rft --round 1`` on a fresh store: the bootstrap, round 1's exploration, rft and
    its evaluation, nothing else (no pareto, training or sft_more: rft reads none of them), and
    the ids are the full run's, so a later full run finds them cache hits."""
    overrides = tiny_overrides(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rft_id = stage_flow("rft", round=1, overrides=overrides)
    lines = stage_lines(out.getvalue())
    assert [(r, s) for r, s, _, _ in lines] == [(0, s) for s in BOOTSTRAP] + [
        (1, "explore"),
        (1, "rft"),
        (1, "evaluate"),
    ]
    assert not any(hit for _, _, hit, _ in lines)
    full = [i for r, s, _, i in tiny_flywheel.lines if r == 1]
    explored, ran, evaluated = (i for *_, i in lines[-3:])
    assert rft_id == ran and full[0] == explored  # explore comes first in the full run
    assert full[-2:] == [ran, evaluated]  # and rft with its evaluation last
    assert "[round 1] rft reads this round's exploration only" in out.getvalue()
    stages = {p.parent.parent.name for p in (tmp_path / "store").rglob("manifest.json")}
    assert stages == set(BOOTSTRAP) | {"explore", "rft"}


def test_stage_flow_force_writes_one_new_version_and_stops(tiny_flywheel, tmp_path):
    # a copy of the store: the new sft version would make later runs redo what follows it
    shutil.copytree(tiny_flywheel.root / "store", tmp_path / "store")
    overrides = tiny_overrides(tmp_path)
    before = manifests(tmp_path)
    sft_id = next(a for r, s, _, a in tiny_flywheel.lines if (r, s) == (0, "sft"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        new_id = stage_flow("sft", round=0, overrides=overrides, force=True)
    assert new_id == sft_id + ".2"
    assert out.getvalue().startswith("config: the built-in defaults (no config file) with ")
    lines = stage_lines(out.getvalue())
    assert [s for _, s, _, _ in lines] == BOOTSTRAP[:-1]
    assert all(hit for _, s, hit, _ in lines if s != "sft")
    assert lines[-1][2:] == (False, new_id)
    assert manifests(tmp_path) - before == {f"store/tiny/round-0/sft/{new_id}"}
    store = Store(str(tmp_path / "store"), "tiny")
    assert store.latest("sft", round=0).id == new_id
    assert store.get(new_id).inputs == store.get(sft_id).inputs


def test_report_json(tiny_flywheel, capsys):
    path = write_tiny_yaml(tiny_flywheel.root)
    run_flywheel(tiny_flywheel.overrides, rounds=1)  # the report reads the last run's evaluations
    capsys.readouterr()
    assert main(["report", "--json", "--config", str(path)]) == 0
    out, err = capsys.readouterr()
    rows = json.loads(out)
    assert isinstance(rows, list) and rows
    evaluations = [a for r, s, _, a in tiny_flywheel.lines if s == "evaluate"]
    assert [row["eval_id"] for row in rows] == evaluations
    assert [(row["round"], row["policy"]) for row in rows] == [
        (0, "init"), (0, "sft"), (1, "dpo"), (1, "sft_more"), (1, "rft"),
    ]  # fmt: skip
    store = Store(str(tiny_flywheel.root / "store"), "tiny")
    for row in rows:
        assert row["env"] == "arith"
        assert row["n_tasks"] == 8 and isinstance(row["n_tasks"], int)
        summary = store.get(row["eval_id"]).summary
        assert row["success_rate"] == summary["arith/success_rate"]
        assert row["avg_reward"] == summary["arith/avg_reward"]
        assert row["checkpoint"] == store.get(row["eval_id"]).manifest["policy"]
        assert row["policy"] == store.get(row["checkpoint"]).stage
        p = row["success_rate"]
        assert row["success_se"] == pytest.approx((p * (1 - p) / 8) ** 0.5)
    dpo = rows[2]
    assert dpo["gain_over_sft"]["over"] == "sft"
    # every evaluation ran the same 8 test tasks: the gains' errors are paired, task by task
    assert dpo["gain_over_sft"]["paired"] is True
    assert dpo["gain_over_baselines"]["paired"] is True
    assert dpo["gain_over_sft"]["gain"] == pytest.approx(
        dpo["success_rate"] - rows[1]["success_rate"]
    )
    best = max(rows[3:], key=lambda r: r["success_rate"])
    assert dpo["gain_over_baselines"]["over"] == best["policy"]
    # the table form shows the same policies, then the round's gains
    assert main(["report", "--config", str(path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:4] == ["round", "policy", "env", "success"]
    assert [line.split()[1] for line in table[2 : 2 + len(rows)]] == [r["policy"] for r in rows]
    assert "±" in table[2] and any(line.startswith("  round 1 dpo") for line in table)


def test_run_writes_the_html_report_of_its_evaluations(tiny_flywheel):
    """`flywheel run` ends by writing the HTML report of the run (and naming it)."""
    page = tiny_flywheel.root / "work" / "report" / "tiny" / "index.html"
    assert f"HTML report: {page}" in tiny_flywheel.printed
    html = page.read_text()
    for row in tiny_flywheel.report:
        assert row["eval_id"] in html, row["eval_id"]
    assert list((page.parent / "trajectories").glob("round-1-*-best.html"))


def test_report_during_a_run_shows_that_runs_rows_so_far(
    tiny_flywheel, tmp_path, monkeypatch, capsys
):
    """A run records its evaluations as they finish: one stopped in round 1 (here its explore
    fails) leaves a report of its bootstrap's two rows with a note, not the previous run's rows;
    rerunning it to its end clears the note."""
    import stages.explore

    shutil.copytree(tiny_flywheel.root / "store", tmp_path / "store")
    overrides = tiny_overrides(tmp_path)
    path = write_tiny_yaml(tmp_path)
    store = Store(str(tmp_path / "store"), "tiny")
    full = [a for _, s, _, a in tiny_flywheel.lines if s == "evaluate"]

    def stopped(*args, **kwargs):
        raise RuntimeError("explore stopped by the test")

    monkeypatch.setattr(stages.explore, "run", stopped)
    with pytest.raises(RuntimeError, match="stopped by the test"):
        run_flywheel(overrides, rounds=1)
    state = json.loads((Path(store.base) / "flywheel.json").read_text())
    assert state["finished"] is False and state["evaluations"] == full[:2]
    capsys.readouterr()
    assert main(["report", "--json", "--config", str(path)]) == 0
    out, err = capsys.readouterr()
    assert [row["eval_id"] for row in json.loads(out)] == full[:2]
    assert err.startswith("note: the last `flywheel run` of tiny has not finished")
    assert err.rstrip().endswith("2 of its evaluations so far") and err.count("\n") == 1

    monkeypatch.undo()
    run_flywheel(overrides, rounds=1)  # every stage a cache hit
    state = json.loads((Path(store.base) / "flywheel.json").read_text())
    assert state["finished"] is True and state["evaluations"] == full
    assert not list(Path(store.base).glob("flywheel.json.part"))
    capsys.readouterr()
    assert main(["report", "--config", str(path)]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("round")
