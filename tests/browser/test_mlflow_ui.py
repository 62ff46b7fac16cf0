"""The real MLflow UI on a tracked 2-round flywheel (the tiny one, or a real run's with
FLYWHEEL_SCREENSHOT_RUN: see tests/browser/conftest.py), in headless Chromium: the experiment
lands on its runs, the parent run's learning curve shows the rounds' success rates, and the
compare-runs page of round 1 and round 2 shows the eval artifacts' numbers.

    pytest tests/browser/test_mlflow_ui.py
    FLYWHEEL_SCREENSHOTS=docs/images pytest tests/browser/test_mlflow_ui.py   # README pictures
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from tests.browser.conftest import Tracked
from tests.flywheel.test_tracking import start_server, stop_server

pytestmark = pytest.mark.slow
WAIT = 60  # seconds for a page element; a page normally renders in 1-3 s


@pytest.fixture(scope="module")
def tracked(tracked_run: Tracked) -> Iterator[Tracked]:
    """The tracked 2-round flywheel (tests/browser/conftest.py) with ``mlflow server`` on its
    SQLite database."""
    url, proc = start_server(tracked_run.tracking_uri, tracked_run.root)
    tracked_run.url = url
    tracked_run.tracker.uri = url  # the links point at this server
    try:
        yield tracked_run
    finally:
        stop_server(proc)


def wait_for(browser, css: str, text: str | None = None, timeout: float = WAIT):
    """The elements matching ``css`` once one of them is shown (and one holds ``text``, shown
    or scrolled out of its table's view)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def found(driver):
        elements = driver.find_elements(By.CSS_SELECTOR, css)
        if not any(e.is_displayed() for e in elements):
            return False
        if text is not None and not any(text in content(e) for e in elements):
            return False
        return elements

    return WebDriverWait(browser, timeout, poll_frequency=0.25).until(
        found, f"no {css!r}{f' with {text!r}' if text else ''} on {browser.current_url}"
    )


def content(element) -> str:
    """An element's text, also where its table clips it from view (Selenium's ``.text`` is
    the visible text only)."""
    return (element.get_attribute("textContent") or "").strip()


def close_assistant(browser) -> None:
    """Hide MLflow's assistant side panel, so the screenshots show the page."""
    from selenium.webdriver.common.by import By

    for button in browser.find_elements(By.CSS_SELECTOR, "[data-assistant-ui] button"):
        if (button.get_attribute("aria-label") or "").lower() == "close":
            button.click()
            return


def number(text: str) -> float:
    return float(text.split("(")[0].strip().replace(",", ""))


def shows(text: str, value: float) -> bool:
    """Whether ``text`` is ``value`` as the UI rounds it (to the decimals it shows, at most 3)."""
    digits = text.split("(")[0].strip()
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    return math.isclose(number(text), value, abs_tol=max(0.5 * 10**-decimals, 1e-3) + 1e-9)


def test_experiment_lands_on_runs_and_rounds_compare(tracked, browser, screenshot):
    from selenium.webdriver.common.by import By

    # the experiment opens on its runs table (not the GenAI overview), parent run listed
    browser.get(tracked.tracker.ui_url())
    parent_name = tracked.tracker._mlflow.get_run(tracked.parent).info.run_name
    wait_for(browser, "body", parent_name)
    assert "/runs" in browser.current_url and "/overview" not in browser.current_url

    # the learning curve: the rounds' success on one chart with init and the baselines
    keys = ["arith/success_rate", *(f"arith/{p}/success_rate" for p in tracked.references)]
    browser.get(tracked.tracker.chart_url([tracked.parent], keys))
    wait_for(browser, ".js-plotly-plot, .plot-container, svg.main-svg")
    rows = wait_for(browser, "tr, [role=row]", "(step=2)")
    shown = {}
    for row in rows:
        cells = [c.text for c in row.find_elements(By.CSS_SELECTOR, "td, [role=cell]")]
        if len(cells) >= 4 and cells[0] in keys:
            shown[cells[0]] = cells[1:4]  # latest, min, max
    assert set(shown) == set(keys), shown
    rates = {r: e.summary["arith/success_rate"] for r, e in tracked.evals.items()}
    latest, low, high = shown["arith/success_rate"]
    assert latest.endswith("(step=2)") and number(latest) == pytest.approx(rates[2], abs=1e-3)
    assert number(low) == pytest.approx(min(rates.values()), abs=1e-3)
    assert number(high) == pytest.approx(max(rates.values()), abs=1e-3)
    for policy in ("sft_more", "rft"):
        value = tracked.baselines[policy].summary["arith/success_rate"]
        assert number(shown[f"arith/{policy}/success_rate"][0]) == pytest.approx(value, abs=1e-3)
    close_assistant(browser)
    screenshot("mlflow-learning-curve")

    # round 1 against round 2 on MLflow's compare-runs page: every number of both evaluations
    pair = [tracked.rounds[1], tracked.rounds[2]]
    browser.get(tracked.tracker.compare_url(pair))
    wait_for(browser, "body", "Comparing 2 Runs")
    names = wait_for(browser, "a[title='Plot chart']", "arith/success_rate")
    grid = shown_grid(browser, names, pair)
    header = browser.find_element(By.CSS_SELECTOR, "thead")
    browser.execute_script(
        "arguments[0].scrollIntoView({block: 'start', inline: 'nearest'});"
        "document.querySelectorAll('[role=grid]').forEach(g => { g.scrollLeft = 0; });",
        header,
    )
    for round_, run_id in zip((1, 2), pair, strict=True):
        summary = tracked.evals[round_].summary
        numeric = {k: v for k, v in summary.items() if isinstance(v, (int, float))}
        assert set(grid[run_id]) == set(numeric), (round_, grid[run_id])
        for key, value in numeric.items():
            assert shows(grid[run_id][key], value), (round_, key, grid[run_id][key], value)
    headers = browser.find_element(By.CSS_SELECTOR, "body").text
    assert "round-1" in headers and "round-2" in headers
    close_assistant(browser)
    screenshot("mlflow-compare-rounds")


def shown_grid(browser, names: list, run_ids: list[str]) -> dict[str, dict[str, str]]:
    """run id -> metric -> the value shown in the compare page's metrics table, matched by
    position: a value sits in its metric's row and under its run's column header."""
    from selenium.webdriver.common.by import By

    columns = {}
    for link in browser.find_elements(By.CSS_SELECTOR, "thead a"):
        if content(link) in run_ids:
            columns[content(link)] = link.rect["x"] + link.rect["width"] / 2
    assert set(columns) == set(run_ids), columns
    # the values grid is the next grid after the one holding the metric names
    name_grid = names[0].find_element(By.XPATH, "ancestor::div[@role='grid']")
    values = name_grid.find_elements(
        By.XPATH, "following::div[@role='grid'][1]//span[normalize-space(text())!='']"
    )
    rows = {content(n): n.rect["y"] + n.rect["height"] / 2 for n in names if content(n)}
    out: dict[str, dict[str, str]] = {r: {} for r in run_ids}
    for cell in values:
        y = cell.rect["y"] + cell.rect["height"] / 2
        x = cell.rect["x"] + cell.rect["width"] / 2
        metric = min(rows, key=lambda k: abs(rows[k] - y))
        run = min(columns, key=lambda k: abs(columns[k] - x))
        if abs(rows[metric] - y) < 12:
            out[run][metric] = content(cell)
    return out
