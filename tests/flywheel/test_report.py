"""flywheel.report: binomial standard errors and the gains of the rounds over the SFT policy and
the best baseline, worked by hand."""

import json
import math
from pathlib import Path

import pytest

import flywheel.store
from flywheel.cli import main
from flywheel.report import (
    add_gains,
    collect,
    compare,
    format_table,
    lineage_hosts,
    paired_standard_error,
    run_spread,
    standard_error,
)
from flywheel.store import ArtifactError, Store, host_info, host_label
from tests.flywheel.test_html_report import _checkpoint, _evaluate


def row(round_: int, policy: str, p: float, n: int = 1000) -> dict:
    return {
        "round": round_, "policy": policy, "env": "arith", "success_rate": p, "n_tasks": n,
        "success_se": standard_error(p, n),
    }  # fmt: skip


def test_standard_error_by_hand():
    assert standard_error(0.5, 400) == pytest.approx(0.025)  # sqrt(.25 / 400)
    assert standard_error(0.0, 10) == 0.0
    assert math.isnan(standard_error(0.5, 0))


def test_gains_over_sft_and_the_best_baseline():
    rows = [
        row(0, "sft", 0.30),
        row(1, "dpo", 0.36),
        row(2, "dpo", 0.33),
        row(2, "sft_more", 0.31),
        row(2, "rft", 0.32),
    ]
    add_gains(rows)
    r1, r2 = rows[1], rows[2]
    # se of a difference: sqrt(se_a^2 + se_b^2); at p=.36 and .30, n=1000: 0.0152 and 0.0145
    se = math.sqrt(0.36 * 0.64 / 1000 + 0.30 * 0.70 / 1000)
    assert r1["gain_over_sft"]["gain"] == pytest.approx(0.06)
    assert r1["gain_over_sft"]["se"] == pytest.approx(se)
    assert r1["gain_over_sft"]["significant"] is True  # 0.06 > 2 * 0.0210
    assert r1["gain_over_baselines"]["over"] == "rft"  # the better baseline
    assert r2["gain_over_baselines"]["gain"] == pytest.approx(0.01)
    assert r2["gain_over_baselines"]["significant"] is False
    for baseline in rows[3:]:
        assert "gain_over_sft" not in baseline and "gain_over_baselines" not in baseline
    assert "gain_over_sft" not in rows[0]
    text = format_table(rows)
    assert "36.0% ± 1.5" in text
    # without the episodes the rates are treated as independent, and the report says so
    assert "round 1 dpo   arith    vs sft       +6.0 ± 2.1* (unpaired)" in text
    assert "vs rft       +1.0 ± 2.1  (unpaired)" in text  # round 2: within noise, no mark
    assert "(points ± standard error, unpaired: the two rates treated as independent" in text
    assert r1["gain_over_sft"]["paired"] is False


def test_a_round_below_its_reference_is_marked():
    """A loss beyond two standard errors is as much a finding as a gain: marked "!"."""
    rows = [row(0, "sft", 0.30), row(1, "dpo", 0.27), row(1, "rft", 0.37)]
    add_gains(rows)
    g = rows[1]["gain_over_baselines"]
    assert g["gain"] == pytest.approx(-0.10) and g["below"] is True and g["significant"] is False
    within = rows[1]["gain_over_sft"]  # -3.0 +- 2.0: not beyond two
    assert within["below"] is False and within["significant"] is False
    text = format_table(rows)
    assert "vs rft      -10.0 ± 2.1! (unpaired)" in text
    assert "vs sft       -3.0 ± 2.0  (unpaired)" in text
    assert "* = more than two above, ! = more than two below" in text


def test_paired_standard_error_by_hand():
    # d = [0, 1, 0, 0]: mean 1/4, mean of d^2 1/4, so sqrt((1/4 - 1/16) / 4)
    assert paired_standard_error([1, 1, 0, 0], [1, 0, 0, 0]) == pytest.approx(math.sqrt(3 / 64))
    assert paired_standard_error([1, 0, 1], [1, 0, 1]) == 0.0  # same outcomes: no noise
    assert math.isnan(paired_standard_error([], []))
    with pytest.raises(ValueError, match="differ in length: 2 and 1"):
        paired_standard_error([1, 0], [1])


def outcomes_of(solved: range, n: int = 1000, env: str = "arith") -> dict:
    return {(env, f"t{i:04d}"): float(i in solved) for i in range(n)}


def test_gains_are_paired_over_the_same_tasks():
    """Two policies that agree on most tasks: the paired standard error counts only the tasks
    where they differ, so a 6-point gain made of 60 newly solved tasks is far beyond noise, and
    30 tasks gained with 30 others lost is a gain of zero whose error is not zero."""
    sft = {**row(0, "sft", 0.30), "eval_id": "e-sft"}
    r1 = {**row(1, "dpo", 0.36), "eval_id": "e-r1"}
    r2 = {**row(2, "dpo", 0.30), "eval_id": "e-r2"}
    rft = {**row(2, "rft", 0.30), "eval_id": "e-rft"}
    outcomes = {
        "e-sft": outcomes_of(range(0, 300)),
        "e-r1": outcomes_of(range(0, 360)),
        "e-r2": outcomes_of(range(30, 330)),
        "e-rft": outcomes_of(range(0, 300)),
    }
    rows = [sft, r1, r2, rft]
    add_gains(rows, outcomes)
    g = r1["gain_over_sft"]
    assert g["paired"] is True and g["gain"] == pytest.approx(0.06)
    assert g["se"] == pytest.approx(math.sqrt((0.06 - 0.06**2) / 1000))  # 0.0075, not 0.021
    assert g["significant"] is True
    g = r2["gain_over_baselines"]
    assert g["over"] == "rft" and g["gain"] == pytest.approx(0.0)
    assert g["se"] == pytest.approx(math.sqrt(0.06 / 1000))  # 60 discordant tasks of 1000
    assert g["significant"] is False
    text = format_table(rows)
    assert "paired over the same test tasks" in text and "(unpaired)" not in text
    assert "round 1 dpo   arith    vs sft       +6.0 ± 0.8*" in text


def test_gains_fall_back_to_unpaired_when_the_tasks_differ():
    sft = {**row(0, "sft", 0.30), "eval_id": "e-sft"}
    r1 = {**row(1, "dpo", 0.36), "eval_id": "e-r1"}
    outcomes = {"e-sft": outcomes_of(range(0, 300)), "e-r1": outcomes_of(range(0, 360), n=999)}
    add_gains([sft, r1], outcomes)
    g = r1["gain_over_sft"]
    assert g["paired"] is False
    assert g["se"] == pytest.approx(math.sqrt(0.36 * 0.64 / 1000 + 0.30 * 0.70 / 1000))
    add_gains([sft, r1], {"e-sft": outcomes_of(range(0, 300))})  # one evaluation unknown
    assert r1["gain_over_sft"]["paired"] is False


def test_env_specific_metrics_are_columns_only_when_reported():
    rows = [row(0, "sft", 0.30)]
    assert "recall_at_5" not in format_table(rows) and "recovery_rate" not in format_table(rows)
    rows.append({**row(0, "sft", 0.20), "env": "wiki", "recall_at_5": 0.75})
    header = format_table(rows).splitlines()[0].split()
    assert header[-1] == "recall_at_5" and "recovery_rate" not in header
    assert format_table(rows).splitlines()[3].split()[-1] == "0.750"


def test_a_baseline_evaluated_several_times_counts_as_its_mean():
    """rft.repeats=2: two rft runs with other data orders, 40% and 30%. The round (36%) is
    measured against their task-by-task mean (35%), paired, not against the better draw."""
    sft = {**row(0, "sft", 0.30), "eval_id": "e-sft"}
    r2 = {**row(2, "grpo", 0.36), "eval_id": "e-r2"}
    rft_a = {**row(2, "rft", 0.40), "eval_id": "e-a"}
    rft_b = {**row(2, "rft", 0.30), "eval_id": "e-b"}
    more = {**row(2, "sft_more", 0.33), "eval_id": "e-more"}
    outcomes = {
        "e-sft": outcomes_of(range(0, 300)),
        "e-r2": outcomes_of(range(0, 360)),
        "e-a": outcomes_of(range(0, 400)),
        "e-b": outcomes_of(range(50, 350)),
        "e-more": outcomes_of(range(0, 330)),
    }
    rows = [sft, r2, rft_a, rft_b, more]
    add_gains(rows, outcomes)
    g = r2["gain_over_baselines"]
    assert g["over"] == "rft (mean of 2)" and g["paired"] is True
    assert g["gain"] == pytest.approx(0.01)
    # d = r2 - mean(a, b) per task: +0.5 on tasks 0-49 and 350-359 (r2 and a solve them, b
    # does not), -0.5 on 360-399 (a alone), 0 elsewhere.
    d = [0.5] * 60 + [-0.5] * 40 + [0.0] * 900
    mean = sum(d) / 1000
    assert mean == pytest.approx(0.01)
    se = math.sqrt((sum(x * x for x in d) / 1000 - mean**2) / 1000)
    assert g["se"] == pytest.approx(se)
    assert set(outcomes) == {"e-sft", "e-r2", "e-a", "e-b", "e-more"}  # the caller's, untouched
    assert "vs rft (mean of 2)  +1.0 ±" in format_table(rows)
    # One rft run: the round is measured against it, as before.
    add_gains([sft, r2, rft_b, more], outcomes)
    assert r2["gain_over_baselines"]["over"] == "sft_more"  # 33% beats the one rft run's 30%


def test_a_round_trained_several_times_is_measured_by_its_mean():
    """iteration.repeats=2: round 2 trained twice on its data, 36% and 40%. Each repeat keeps its
    own row and gains; both carry the repeats' task-by-task mean (38%) and its gains, paired,
    over the SFT policy and over the mean of two rft runs; the table prints it as one more line."""
    sft = {**row(0, "sft", 0.30), "eval_id": "e-sft"}
    r2a = {**row(2, "sft", 0.36), "eval_id": "e-r2a", "seed": 0}
    r2b = {**row(2, "sft", 0.40), "eval_id": "e-r2b", "seed": 1}
    rft_a = {**row(2, "rft", 0.34), "eval_id": "e-a"}
    rft_b = {**row(2, "rft", 0.30), "eval_id": "e-b"}
    outcomes = {
        "e-sft": outcomes_of(range(0, 300)),
        "e-r2a": outcomes_of(range(0, 360)),
        "e-r2b": outcomes_of(range(40, 440)),
        "e-a": outcomes_of(range(0, 340)),
        "e-b": outcomes_of(range(0, 300)),
    }
    rows = [sft, r2a, r2b, rft_a, rft_b]
    add_gains(rows, outcomes)
    assert r2a["gain_over_sft"]["gain"] == pytest.approx(0.06)  # each repeat's own gain
    assert r2b["gain_over_sft"]["gain"] == pytest.approx(0.10)
    mean = r2a["repeats"]
    assert r2b["repeats"] is mean and "repeats" not in sft and "repeats" not in rft_a
    assert mean["of"] == ["e-r2a", "e-r2b"] and mean["success_rate"] == pytest.approx(0.38)
    assert mean["success_se"] == pytest.approx(standard_error(0.38, 1000))
    g = mean["gain_over_sft"]
    assert g["paired"] is True and g["gain"] == pytest.approx(0.08)
    # d = mean(r2a, r2b) - sft per task: -0.5 on 0-39 (r2b misses them), +1 on 300-359 (both
    # solve them), +0.5 on 360-439 (r2b alone), 0 elsewhere.
    d = [-0.5] * 40 + [1.0] * 60 + [0.5] * 80 + [0.0] * 820
    m = sum(d) / 1000
    assert g["se"] == pytest.approx(math.sqrt((sum(x * x for x in d) / 1000 - m**2) / 1000))
    b = mean["gain_over_baselines"]
    assert b["over"] == "rft (mean of 2)" and b["gain"] == pytest.approx(0.38 - 0.32)
    table = format_table(rows)
    assert "round 2 sft (seed 1) arith" in table
    assert "round 2 sft (mean of 2) arith    vs sft       +8.0 ±" in table
    assert table.count("vs rft (mean of 2)") == 3  # each repeat and their mean
    # One evaluation of the round: no mean.
    single = [dict(sft), {**row(2, "sft", 0.36), "eval_id": "e-r2a"}, dict(rft_a)]
    add_gains(single, outcomes)
    assert not any("repeats" in r for r in single) and "mean of" not in format_table(single)


def test_compare_notes_lineages_written_on_different_machines(tmp_path, monkeypatch):
    """The same config can train to different weights on another CPU: ``compare`` says when the
    evaluated policies (or anything they were made from) were written on different machines."""
    store = Store(str(tmp_path), run="r")
    sft = _checkpoint(store, "sft", 0, [])
    base = _evaluate(store, sft, 0)
    rft = _checkpoint(store, "rft", 2, [sft.id])
    here = _evaluate(store, rft, 2)
    assert "note:" not in compare(store, here.id, base.id)
    other = {"cpu": "Other CPU", "cpu_flags": ["avx2"], "cores": 2}
    monkeypatch.setattr(flywheel.store, "host_info", lambda: other)
    more = _checkpoint(store, "sft_more", 2, [sft.id])  # its parent was written here
    monkeypatch.undo()
    there = _evaluate(store, more, 2)
    assert lineage_hosts(store, there) == {host_label(host_info()), "Other CPU, avx2"}
    out = compare(store, here.id, there.id).splitlines()
    assert out[-4].startswith("note: these evaluations' lineages were written on different")
    assert out[-2] == f"  {here.id}: {host_label(host_info())}"
    assert out[-1] == f"  {there.id}: " + "; ".join(sorted(lineage_hosts(store, there)))


def test_compare_pairs_evaluations_of_two_runs_on_the_same_tasks(tmp_path, capsys):
    """``RUN:ID`` reads an evaluation from another run's store under the same root; the two are
    paired task by task when every shared task reads the same, and refused when one does not."""
    here, there = Store(str(tmp_path), run="a"), Store(str(tmp_path), run="b")
    round2 = _evaluate(here, _checkpoint(here, "dpo", 2, []), 2)  # first 8 of 12 solved
    sft = _evaluate(there, _checkpoint(there, "sft", 0, []), 0)  # first 3 solved
    out = compare(here, round2.id, f"b:{sft.id}").splitlines()
    assert out[0] == f"{round2.id} (A) against b:{sft.id} (B), paired over the tasks all ran:"
    xa, xb = [float(i < 8) for i in range(12)], [float(i < 3) for i in range(12)]
    se = 100 * paired_standard_error(xa, xb)
    assert out[1] == f"  arith       12 tasks   A  66.7%   B  25.0%   A - B +41.7 ± {se:.1f}*"
    # The same from the other run's side, through the command line.
    capsys.readouterr()
    assert main(["compare", f"a:{round2.id}", sft.id, f"run.store={tmp_path}", "run.name=b"]) == 0
    assert f"A - B +41.7 ± {se:.1f}*" in capsys.readouterr().out
    # Another run whose task arith-test-4 reads differently: not paired.
    other = Store(str(tmp_path), run="c")
    moved = _evaluate(other, _checkpoint(other, "sft", 0, []), 0)
    table = other.read(moved).to_pylist()
    for row in table:
        if row["task_id"] == "arith-test-4":
            row["messages"][2]["content"] = "another question"
    w = other.writer("eval", stage="evaluate", round=0, config={"tag": "moved"}, inputs=[])
    w.write_shard(0, table)
    changed = w.commit(summary=moved.summary)
    with pytest.raises(ValueError, match="task arith-test-4 of env arith reads differently"):
        compare(here, round2.id, f"c:{changed.id}")
    with pytest.raises(ArtifactError):
        compare(here, round2.id, f"no-such-run:{sft.id}")
    assert main(["compare", "a/b:x", sft.id]) == 2
    assert "is not a plain name" in capsys.readouterr().err


def test_compare_by_difficulty_pairs_each_level(tmp_path, capsys):
    """``--by-difficulty`` follows each env's line with one per difficulty level, paired over
    that level's tasks only: where a gain comes from."""
    store = Store(str(tmp_path), run="a")
    round2 = _evaluate(store, _checkpoint(store, "dpo", 2, []), 2)  # tasks 0-7 of 12 solved
    sft = _evaluate(store, _checkpoint(store, "sft", 0, []), 0)  # tasks 0-2 solved
    out = compare(store, round2.id, sft.id, by_difficulty=True).splitlines()
    arith = [line for line in out if line.startswith("  arith")]
    assert arith and arith[0].endswith("A  66.7%   B  25.0%   A - B +41.7 ± 14.2*")
    i = out.index(arith[0])
    # difficulty 1 + i % 3: level 1 holds tasks 0, 3, 6, 9 (A solves 0, 3, 6; B 0), level 2
    # tasks 1, 4, 7, 10 (A 1, 4, 7; B 1), level 3 tasks 2, 5, 8, 11 (A 2, 5; B 2).
    for line, level, solved_a in zip(out[i + 1 : i + 4], (1, 2, 3), (3, 3, 2), strict=True):
        xa = [float(k < solved_a) for k in range(4)]
        xb = [float(k == 0) for k in range(4)]
        se = 100 * paired_standard_error(xa, xb)
        gain = 100 * (solved_a - 1) / 4
        mark = "*" if gain > 2 * se else " "
        assert line == (
            f"    difficulty {level:<4}     4 tasks   A {25 * solved_a:5.1f}%   B  25.0%   "
            f"A - B {gain:+5.1f} ± {se:.1f}{mark}"
        )
    # Without the flag no level lines; the flag through the command line.
    assert not any("difficulty" in line for line in compare(store, round2.id, sft.id).split("\n"))
    capsys.readouterr()
    args = ["compare", round2.id, sft.id, "--by-difficulty", f"run.store={tmp_path}", "run.name=a"]
    assert main(args) == 0
    assert "    difficulty 3        4 tasks   A  50.0%" in capsys.readouterr().out


def test_run_spread_by_hand():
    """Round 2 trained twice (55.8%, 55.8%) against two rft runs (54.5%, 47.9%): the runs'
    variance pooled over both sides is (0 + 2 * 0.033^2) / 2, the error of the difference of the
    means sqrt(var * (1/2 + 1/2)) = 0.033, and 4.55 points are below t(2) = 4.303 of them."""
    spread = run_spread([0.558, 0.558], [0.545, 0.479])
    assert spread is not None
    assert spread["df"] == 2 and spread["n"] == [2, 2] and spread["t"] == pytest.approx(4.303)
    assert spread["se"] == pytest.approx(0.033)
    assert spread["significant"] is False and spread["below"] is False
    # One run on a side borrows the other side's spread: df 1, t 12.706.
    one = run_spread([0.60], [0.50, 0.52])
    assert one is not None and one["df"] == 1 and one["t"] == pytest.approx(12.706)
    assert one["se"] == pytest.approx(math.sqrt(2 * 0.01**2 / 1 * (1 + 1 / 2)))
    # Runs that agree closely make a small gain significant; a large drop is marked below.
    tight = run_spread([0.60, 0.61, 0.60], [0.50, 0.51, 0.50])
    assert tight is not None and tight["df"] == 4 and tight["significant"] is True
    assert run_spread([0.40, 0.41], [0.60, 0.61])["below"] is True  # type: ignore[index]
    assert run_spread([0.6], [0.5]) is None and run_spread([], [0.5, 0.6]) is None


def test_gains_over_repeated_baselines_carry_the_runs_spread():
    """With rft trained twice, a round's gain over the baselines also carries the spread of the
    training runs; a round's repeats carry it on their mean, not on each repeat's own line. One
    run a side has no spread to measure."""
    sft = {**row(0, "sft", 0.30), "eval_id": "e-sft"}
    r1 = {**row(1, "sft", 0.45), "eval_id": "e-r1"}
    r2a = {**row(2, "sft", 0.558), "eval_id": "e-r2a", "seed": 0}
    r2b = {**row(2, "sft", 0.558), "eval_id": "e-r2b", "seed": 1}
    rft_a = {**row(2, "rft", 0.545), "eval_id": "e-a"}
    rft_b = {**row(2, "rft", 0.479), "eval_id": "e-b"}
    rows = [sft, r1, r2a, r2b, rft_a, rft_b]
    add_gains(rows)
    assert r1["gain_over_baselines"]["runs"] == run_spread([0.45], [0.545, 0.479])
    assert "runs" not in r2a["gain_over_baselines"] and "runs" not in r2a["gain_over_sft"]
    mean = r2a["repeats"]["gain_over_baselines"]
    assert mean["runs"] == run_spread([0.558, 0.558], [0.545, 0.479])
    table = format_table(rows)
    assert "round 2 sft (mean of 2) arith" in table
    assert "(runs: ± 3.3, df 2, t 4.30)" in table and "(runs: the gain's standard error" in table
    single = [dict(sft), dict(r1), dict(rft_a)]
    add_gains(single)
    assert "runs" not in single[1]["gain_over_baselines"] and "(runs" not in format_table(single)


def test_run_record_is_written_whole_and_says_when_a_run_has_not_finished(tmp_path):
    from flywheel.report import read_state, unfinished, write_state

    store = Store(str(tmp_path / "store"), "study")
    assert read_state(store) is None and unfinished(store) is None
    write_state(store, 2, ["evaluate-a", "evaluate-b"], finished=False)
    assert read_state(store) == {
        "run": "study", "rounds": 2, "finished": False, "evaluations": ["evaluate-a", "evaluate-b"],
    }  # fmt: skip
    note = unfinished(store)
    assert note is not None and "\n" not in note
    assert note.startswith("note: the last `flywheel run` of study has not finished")
    assert note.endswith("2 of its evaluations so far")
    write_state(store, 2, ["evaluate-a", "evaluate-b", "evaluate-c"], finished=True)
    assert unfinished(store) is None
    assert [p.name for p in Path(store.base).iterdir()] == ["flywheel.json"]  # no .part left
    # a record from before `finished` existed was written at a run's end
    (Path(store.base) / "flywheel.json").write_text(json.dumps({"evaluations": []}))
    assert unfinished(store) is None
    (Path(store.base) / "flywheel.json").write_text('{"evaluations": [')
    with pytest.raises(ArtifactError, match=r"^corrupted run record .*flywheel.json: "):
        read_state(store)


def test_recovery_rate_carries_its_error_over_the_episodes_it_counts(tmp_path):
    """recovery_rate's n is the held-out episodes with an invalid or failed action
    (``failed_episodes``), not the test tasks: 100 of 400 is 25.0% ± 2.2."""
    from tests.flywheel.test_html_report import _put

    store = Store(str(tmp_path / "store"), "study")
    sft = _checkpoint(store, "sft", 0, [])
    plain = _evaluate(store, sft, 0)
    rnd = _checkpoint(store, "dpo", 1, [sft.id])
    summary = {k: v for k, v in plain.summary.items() if k.startswith("arith/")}
    summary.update({"arith/recovery_rate": 0.25, "arith/failed_episodes": 400.0})
    rows = [{**r, "policy": rnd.id, "policy_stage": "dpo", "round": 1}
            for r in store.read(plain).to_pylist() if r["env"] == "arith"]  # fmt: skip
    extra = {"policy": rnd.id, "policy_stage": "dpo"}
    with_recovery = _put(store, "eval", "evaluate", 1, rows, [rnd.id], summary=summary, extra=extra)
    found = {(r["round"], r["env"]): r for r in collect(store)}
    assert found[(1, "arith")]["recovery_se"] == pytest.approx(math.sqrt(0.25 * 0.75 / 400))
    assert "recovery_se" not in found[(0, "arith")]
    text = format_table(collect(store))
    header, *lines = text.splitlines()
    assert header.split()[-1] == "recovery_rate"
    assert any(line.startswith("    1") and line.endswith("25.0% ± 2.2") for line in lines), text
    assert "(recovery_rate: of the held-out episodes with an invalid or failed action" in text
    # no episode with an invalid or failed action: the rate is over nothing, not 0%
    none_failed = {**summary, "arith/recovery_rate": 0.0, "arith/failed_episodes": 0.0}
    _put(store, "eval", "evaluate", 2, rows, [rnd.id], summary=none_failed, extra=extra)
    lines = format_table(collect(store)).splitlines()
    assert any(line.startswith("    2") and line.endswith("no failures") for line in lines)
    # compare: a recovery line only where every side reports one; B's rate is over its own
    # failed episodes (unpaired): 25.0% ± 2.2 of 400 against 10.0% ± 1.5 of 400
    bare = {k: v for k, v in summary.items() if "recovery" not in k and "failed" not in k}
    without = _put(store, "eval", "evaluate", 1, rows, [rnd.id], summary=bare, extra=extra)
    assert "recovery" not in compare(store, with_recovery.id, without.id)
    summary.update({"arith/recovery_rate": 0.10})
    other = _put(store, "eval", "evaluate", 1, rows, [rnd.id], summary=summary, extra=extra)
    lines = compare(store, with_recovery.id, other.id).splitlines()
    se = 100 * math.sqrt(0.25 * 0.75 / 400 + 0.1 * 0.9 / 400)
    assert lines[2] == (
        f"    recovery     A 25.0% ± 2.2 of 400   B 10.0% ± 1.5 of 400   A - B +15.0 ± {se:.1f}* "
        "(unpaired; of N: the episodes with an invalid or failed action)"
    )
