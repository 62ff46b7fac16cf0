"""The tiny end-to-end config every stage, flow and CLI test runs on, and the environment the
library expects (set before Prefect, transformers or DeepSpeed are imported).

    def test_something(tiny_config): ...          # a Config whose store lives under tmp_path
    load_config(None, tiny_overrides(tmp_path))   # the same as overrides, for flows and the CLI
    write_tiny_yaml(tmp_path)                     # the same as a YAML file, for `--config`
    def test_flow(tiny_flywheel): ...             # one Prefect `flywheel_flow` run, shared

Prefect runs on its ephemeral server with a fresh PREFECT_HOME per session: measured here, that
is ~3 s faster than `prefect_test_harness` (whose start alone takes ~13 s).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_SESSION_TMP = Path(tempfile.mkdtemp(prefix="flywheel-tests-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_HOME", str(_SESSION_TMP / "prefect"))
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# One BLAS thread: the tiny models are several times faster on a shared 2-core box than with
# threads that spin against each other and the other test processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)

import pytest  # noqa: E402

from flywheel.config import Config, dump_config, load_config  # noqa: E402
from flywheel.envs.arith import ArithSuite  # noqa: E402
from flywheel.store import Store  # noqa: E402


def pytest_unconfigure(config) -> None:
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)  # Prefect's database of this session


# How heavy a test's file is, by its heaviest marker: `make test` spreads files over worker
# processes in collection order, so a minute-long test collected last runs alone at the end.
_FILE_WEIGHT = {"vllm": 3, "integration": 2, "slow": 1}


@pytest.hookimpl(trylast=True)  # after tests/browser/conftest.py marks its tests
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files with the heaviest tests first. The sort is stable and by file, so files of one
    weight keep their order and a file's tests stay together, in their order."""
    weight: dict[Path, int] = {}
    for item in items:
        marked = [w for name, w in _FILE_WEIGHT.items() if item.get_closest_marker(name)]
        weight[item.path] = max(weight.get(item.path, 0), *marked, 0)
    items.sort(key=lambda item: -weight[item.path])


def tiny_overrides(root: Path, *extra: str) -> list[str]:
    """Overrides for a run that takes seconds: 24 train / 8 val / 8 test arith tasks, a 1-layer policy,
    3 SFT steps, K=2 and shards of 8 episodes, both baselines; store and MLflow database under
    ``root``."""
    return [
        f"run.work_dir={root / 'work'}",
        f"run.store={root / 'store'}",
        "run.name=tiny",
        "run.rounds=1",
        "envs.arith.n_train=24",
        "envs.arith.n_val=8",
        "envs.arith.n_test=8",
        "envs.arith.max_steps=3",
        "model.tiny.hidden_size=32",
        "model.tiny.num_layers=1",
        "model.tiny.num_heads=2",
        "model.tiny.intermediate_size=64",
        "model.tiny.max_position_embeddings=512",
        "engine.max_new_tokens=12",
        "sft.epochs=1",
        "sft.micro_batch_size=8",
        "sft.max_steps=3",
        "sft.lr=3e-3",
        "sft.max_length=256",
        "explore.samples_per_task=2",
        "explore.shard_size=8",
        "evaluate.shard_size=8",
        "evaluate.untrained=true",
        "baselines=[sft_more,rft]",
        "sft_more.micro_batch_size=8",
        "sft_more.max_length=256",
        "rft.micro_batch_size=8",
        "rft.max_length=256",
        "rft.max_steps=3",
        "tracking.enabled=false",
        *extra,
    ]


class ArithWithoutNoop(ArithSuite):
    """arith as a user's suite that names no no-op action (``suite: tests.conftest:ArithWithoutNoop``),
    for the checks that refuse to splice such an env."""

    noop = None


def write_tiny_yaml(root: Path, *extra: str) -> Path:
    """The tiny config as a YAML file under ``root`` (the CLI's read-only commands take no overrides)."""
    path = root / "tiny.yaml"
    path.write_text(dump_config(load_config(None, tiny_overrides(root, *extra))))
    return path


@pytest.fixture
def tiny_config(tmp_path: Path) -> Config:
    return load_config(None, tiny_overrides(tmp_path))


# A progress line of the flows: `[round 0] sft          2.7s  sft-2daed9c53e87  loss=7.0087`.
STAGE_LINE = re.compile(r"^\[round (\d+)\] (\S+)\s+(cache hit|[\d.]+s)\s+(\S+)")


def stage_lines(text: str) -> list[tuple[int, str, bool, str]]:
    """(round, stage, cache hit, artifact id) of each progress line the flows printed."""
    found = (STAGE_LINE.match(line) for line in text.splitlines())
    return [(int(m[1]), m[2], m[3] == "cache hit", m[4]) for m in found if m]


@dataclass
class FlywheelRun:
    root: Path
    overrides: list[str]
    printed: str
    seconds: float
    report: list[dict]
    artifacts: set[str]  # ids in the store right after the run

    @property
    def lines(self) -> list[tuple[int, str, bool, str]]:
        return stage_lines(self.printed)


def run_flywheel(overrides: list[str], **kw) -> tuple[str, float, list[dict]]:
    """``flywheel_flow`` in-process; returns what it printed, its wall time and its report."""
    from flows.flywheel import flywheel_flow

    out = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out):
        rows = flywheel_flow(overrides=overrides, **kw)
    return out.getvalue(), time.perf_counter() - start, rows


@pytest.fixture(scope="session")
def tiny_flywheel(tmp_path_factory) -> FlywheelRun:
    """The tiny flywheel (bootstrap + 1 round) run once through Prefect, shared by the flow and
    tracking tests; tests that change its store work on a copy."""
    from prefect import flow

    @flow(name="warm-up")
    def warm_up() -> None:
        """Starts the ephemeral Prefect server, so the timed run below times the stages."""

    warm_up()
    root = tmp_path_factory.mktemp("flywheel")
    overrides = tiny_overrides(root)
    printed, seconds, rows = run_flywheel(overrides, rounds=1)
    cfg = load_config(None, overrides)
    ids = {ref.id for ref in Store(cfg.run.store_root(), cfg.run.name).list()}
    return FlywheelRun(root, overrides, printed, seconds, rows, ids)


@pytest.fixture(scope="session")
def tiny_cli(tiny_flywheel, tmp_path_factory) -> tuple[Path, Store, set[str]]:
    """For CLI commands on the tiny flywheel's artifacts: its config as a YAML file, its store
    and the ids the run itself wrote (other tests add versions to the shared store)."""
    path = tmp_path_factory.mktemp("cli") / "tiny.yaml"
    path.write_text(dump_config(load_config(None, tiny_flywheel.overrides)))
    cfg = load_config(path)
    return path, Store(cfg.run.store_root(), cfg.run.name), tiny_flywheel.artifacts
