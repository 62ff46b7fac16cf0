"""A headless Chromium for the browser tests (the MLflow UI, the HTML report, the Prefect UI).

Debian's ``chromium`` and ``chromium-driver`` packages are installed by ``make test`` (the
``browser`` target of the Makefile); selenium drives them through ``/usr/bin/chromedriver``
given by path, so nothing is downloaded at run time. A missing browser is a test failure, not
a skip: these tests are the proof that the pages render.

    def test_page(browser, screenshot):
        browser.get("http://127.0.0.1:5000/")
        screenshot("mlflow-compare")   # work/screenshots/mlflow-compare.png

Screenshots go to ``$FLYWHEEL_SCREENSHOTS`` (``make screenshots`` points it at docs/images,
where the README's pictures live) or else to the test's tmp folder.

``tracked_run`` is a 2-round flywheel run with MLflow tracking on, shared by the MLflow UI and
HTML report tests: the tiny one (rounds 0-1 are cache hits in a copy of the shared
``tiny_flywheel`` store), or, with ``FLYWHEEL_SCREENSHOT_RUN=<work folder>`` (``make
screenshots`` sets it to the demo's ``work``), a copy of that real run's store rerun with
configs/default.yaml: every stage a cache hit, the run tree and HTML report written afresh.
The README's pictures are of the demo's run, checked by the same assertions.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from flywheel.config import load_config
from flywheel.store import ArtifactRef, Store
from flywheel.tracking import Tracker
from tests.conftest import run_flywheel, stage_lines, tiny_overrides

CHROMIUM = os.environ.get("FLYWHEEL_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("FLYWHEEL_CHROMEDRIVER", "/usr/bin/chromedriver")

# The machine's network is closed: without the background-networking flags Chromium keeps
# trying (and failing) to reach its update and sync hosts.
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--window-size=1400,1000",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/browser/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.browser)
            item.add_marker(pytest.mark.integration)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator:
    """A fresh headless Chromium (its own profile folder) driven by selenium."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (Path(path).is_file() and os.access(path, os.X_OK)):
            pytest.fail(f"{path} is missing: `make browser` installs Debian's chromium packages")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    profile = Path(tempfile.mkdtemp(prefix="chromium-", dir=tmp_path))
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def screenshot(browser, tmp_path: Path) -> Callable[[str], Path]:
    """``screenshot(name)`` saves the browser's window as ``<name>.png`` and returns the path."""
    folder = Path(os.environ.get("FLYWHEEL_SCREENSHOTS") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)

    def take(name: str) -> Path:
        path = folder / f"{name}.png"
        browser.save_screenshot(str(path))
        return path

    return take


@dataclass
class Tracked:
    root: Path
    tracking_uri: str
    tracker: Tracker
    store: Store
    parent: str
    rounds: dict[int, str]  # round -> its round run
    evals: dict[int, ArtifactRef]  # round -> the evaluation of its policy
    baselines: dict[str, ArtifactRef]  # sft_more, rft -> their evaluations
    references: list[str]  # the policies drawn as flat lines: init (when evaluated) and baselines
    report: Path  # the index.html that `flywheel run` wrote
    url: str = ""


@pytest.fixture(scope="session")
def tracked_run(tiny_flywheel, tmp_path_factory) -> Tracked:
    """A 2-round flywheel run with tracking on, in a fresh store copy and MLflow database."""
    from tests.flywheel.test_tracking import MLFLOW_LINE

    root = tmp_path_factory.mktemp("tracked-run")
    real = os.environ.get("FLYWHEEL_SCREENSHOT_RUN")
    if real:
        source = Path(real) / "store"
        overrides = [f"run.work_dir={root / 'work'}", f"run.store={root / 'store'}"]
        config: str | None = str(Path(__file__).resolve().parents[2] / "configs" / "default.yaml")
    else:
        source = tiny_flywheel.root / "store"
        overrides = tiny_overrides(root)
        config = None
    shutil.copytree(source, root / "store")
    overrides += ["tracking.enabled=true", "run.rounds=2"]
    printed, _, _ = run_flywheel(overrides, config=config)
    (parent,) = MLFLOW_LINE.findall(printed)
    cfg = load_config(config, overrides)
    store = Store(cfg.run.store_root(), cfg.run.name)
    evals = [store.get(a) for _, s, _, a in stage_lines(printed) if s == "evaluate"]
    tracker = Tracker(cfg.tracking_uri(), cfg.tracking.experiment)
    assert tracker.client is not None
    runs = tracker.client.search_runs(
        [tracker.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent}'"
    )
    data = Tracked(
        root=root,
        tracking_uri=cfg.tracking_uri(),
        tracker=tracker,
        store=store,
        parent=parent,
        rounds={int(r.data.tags["round"]): r.info.run_id for r in runs},
        evals={e.round: e for e in evals if e.manifest["policy_stage"] in ("sft", "dpo", "grpo")},
        baselines={p: e for e in evals if (p := e.manifest["policy_stage"]) in ("sft_more", "rft")},
        references=[
            p
            for p in ("init", "sft_more", "rft")
            if any(e.manifest["policy_stage"] == p for e in evals)
        ],
        report=Path(cfg.run.work_dir) / "report" / cfg.run.name / "index.html",
    )
    assert sorted(data.rounds) == sorted(data.evals) == [0, 1, 2], printed[-3000:]
    assert f"HTML report: {data.report}" in printed
    return data
