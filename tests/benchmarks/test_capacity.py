"""benchmarks/capacity.py runs a cell's bootstrap through the stages themselves (no Prefect):
its artifacts are the ones `flywheel run` writes with the same overrides, and it reports the
SFT policy's test success with its standard error."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest

from benchmarks import capacity
from flows.flywheel import _plan, _walk
from flywheel.config import load_config
from flywheel.store import Store
from tests.conftest import tiny_overrides


def test_cell_overrides_set_the_width_and_the_demonstrations():
    cfg = load_config(None, capacity.cell_overrides(256, 4000, 1, []))
    tiny = cfg.model.tiny
    assert (tiny.hidden_size, tiny.intermediate_size, tiny.num_heads) == (256, 768, 8)
    assert cfg.expert.n_tasks == 4000 and cfg.run.seed == 1 and cfg.run.rounds == 0
    assert cfg.baselines == [] and cfg.run.name == "cap-w256-d4000-s1"
    with pytest.raises(SystemExit, match="width 100 is not a multiple of 32"):
        capacity.cell_overrides(100, 500, 0, [])


@pytest.mark.slow
def test_a_cell_writes_what_flywheel_run_writes(tmp_path: Path):
    tiny = [
        o for o in tiny_overrides(tmp_path) if not o.startswith(("run.", "baselines", "model."))
    ]
    tiny.append("evaluate.untrained=false")
    default = str(capacity.CHECKOUT / "configs" / "default.yaml")
    out = tmp_path / "capacity.json"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert capacity.main(["--widths", "32", "--demos", "8", "--work", str(tmp_path / "w"),
                              "--out", str(out), *tiny])  == 0  # fmt: skip
    assert "capacity: width 32" in printed.getvalue()
    (cell,) = json.loads(out.read_text())["cells"]
    assert cell["width"] == 32 and cell["demos"] == 8
    rate = cell["success_rate"]
    assert cell["stderr"] == pytest.approx(math.sqrt(rate * (1 - rate) / 8))
    # the same cell through the flow: the same ids, so nothing is trained again
    overrides = [*capacity.cell_overrides(32, 8, 0, tiny), f"run.work_dir={tmp_path / 'w'}"]
    cfg = load_config(default, overrides)
    store = Store(cfg.run.store_root(), cfg.run.name)
    plan = _plan(default, overrides)
    with contextlib.redirect_stdout(io.StringIO()):
        _walk(plan, rounds=0)
    assert plan.store.committed == set()  # every stage a cache hit
    assert store.get(cell["sft"]).kind == "checkpoints"
    assert store.get(cell["eval"]).summary["arith/success_rate"] == rate
