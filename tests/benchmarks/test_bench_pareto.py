"""benchmarks/bench_pareto.py runs against the current flywheel.pareto and flywheel.trajectory
(the import at the top fails if either loses a name it uses) and its check catches a difference."""

from __future__ import annotations

import pytest

from benchmarks import bench_pareto


def test_tiny_run_agrees_and_times_every_part(capsys):
    result = bench_pareto.main(["--n", "400", "--python-n", "160", "--stage"])
    assert result["n"] == 400 and result["subsample"] == 160
    assert result["pairs"] > 0 and result["groups"] > 0
    for side in ("full", "subsample", "python"):
        assert set(result["times"][side]) == {"ranks", "pairs", "groups"}
    assert result["stage_seconds"] is not None and result["stage_seconds"] > 0
    printed = capsys.readouterr().out
    assert "vectorised and plain Python agree on every rank" in printed
    assert f"all {result['pairs']} pairs" in printed
    assert "stage: " in printed and "total" in printed


def test_a_reference_that_loses_the_stored_ids_is_caught(monkeypatch):
    cut = bench_pareto._cut

    def without_ids(row, opening, limit):
        kept = cut(row, opening, limit)
        return None if kept is None else (kept[0], [])

    monkeypatch.setattr(bench_pareto, "_cut", without_ids)
    with pytest.raises(AssertionError, match="vectorised and plain Python differ: pairs"):
        bench_pareto.main(["--n", "160", "--python-n", "80"])


def test_bad_sizes_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench_pareto.main(["--n", "0"])
    assert "--n must be at least 1" in capsys.readouterr().err
