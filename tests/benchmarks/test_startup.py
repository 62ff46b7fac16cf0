"""benchmarks/startup.py refuses what it cannot time, in one line and a non-zero exit."""

from __future__ import annotations

import pytest

from benchmarks import startup


def test_a_work_folder_without_a_store_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        startup.main(["--work-dir", str(tmp_path)])
    assert exit_.value.code == 2
    assert "no store there (run `make demo` first)" in capsys.readouterr().err


def test_a_checkout_without_its_venv_and_zero_repeats_are_refused(tmp_path, capsys):
    (tmp_path / "store").mkdir()
    with pytest.raises(SystemExit) as exit_:
        startup.main(["--work-dir", str(tmp_path), "--against", str(tmp_path)])
    assert exit_.value.code == 2
    assert "no .venv/bin/flywheel there" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        startup.main(["--work-dir", str(tmp_path), "--repeats", "0"])
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err
