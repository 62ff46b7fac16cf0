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
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

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
