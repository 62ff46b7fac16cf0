"""The HTML report in headless Chromium: opened from the file system, every plot renders (each
SVG has a size and drawn marks inside it), the numbers shown equal the eval artifacts', a
trajectory link leads to its page with loss flags; the same pages served over HTTP on
127.0.0.1 link the same way. Runs on the store of tests/flywheel/test_html_report.py, whose
success counts are chosen there."""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium.webdriver.common.by import By

from flywheel.html_report import write_html
from flywheel.report import COLUMNS, _cell, collect
from flywheel.store import Store
from tests.flywheel import test_html_report as synthetic

# Per plot: the SVG's box, and its marks' boxes (a line is drawn when it has a length).
MEASURE = """
return Array.from(document.querySelectorAll('figure.plot svg')).map(svg => {
  const box = svg.getBoundingClientRect();
  const marks = Array.from(svg.querySelectorAll('.mark')).map(m => {
    const b = m.getBoundingClientRect();
    return {tag: m.tagName, w: b.width, h: b.height,
            inside: b.left >= box.left - 2 && b.right <= box.right + 2 &&
                    b.top >= box.top - 2 && b.bottom <= box.bottom + 2,
            fill: getComputedStyle(m).fill, stroke: getComputedStyle(m).stroke};
  });
  return {figure: svg.closest('figure').id, w: box.width, h: box.height, marks: marks};
});
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[Store, Path]:
    root = tmp_path_factory.mktemp("html-report-browser")
    store = synthetic.build_store(root / "store")
    return store, write_html(store, root / "report")


@pytest.fixture
def server(report) -> Iterator[str]:
    """The report folder served by Python's HTTP server on 127.0.0.1."""
    handler = functools.partial(
        http.server.SimpleHTTPRequestHandler, directory=str(report[1].parent)
    )
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def test_every_plot_renders_and_the_numbers_match(browser, report):
    store, index = report
    browser.get(index.as_uri())
    assert browser.title == "flywheel report: tiny"
    plots = browser.execute_script(MEASURE)
    envs = synthetic.ENVS
    assert [p["figure"] for p in plots] == [
        *(f"success-by-round-{env}" for env in envs),
        *(f"success-by-difficulty-{env}" for env in envs),
        "explore-reward",
        "explore-tool-calls",
        "pareto-front",
        "pareto-front",  # reward against tokens, and against tool calls
    ]
    for plot in plots:
        assert plot["w"] > 100 and plot["h"] > 100, plot["figure"]
        marks = plot["marks"]
        drawn = [m for m in marks if m["w"] > 0 and (m["h"] > 0 or m["tag"] == "line")]
        assert drawn and all(m["inside"] for m in marks), plot["figure"]
        painted = [m for m in drawn if m["fill"] not in ("none", "") or m["tag"] == "line"]
        assert len(painted) == len(drawn), plot["figure"]

    # The success points and reference lines carry the eval artifacts' rates.
    summaries = {ref.id: ref.summary for ref in store.list(stage="evaluate")}
    for env in envs:
        marks = browser.find_elements(By.CSS_SELECTOR, f"#success-by-round-{env} .mark")
        assert len(marks) == len(synthetic.SOLVED)
        for mark in marks:
            summary = summaries[mark.get_attribute("data-eval-id")]
            assert float(mark.get_attribute("data-success")) == summary[f"{env}/success_rate"]

    # The table shows what `flywheel report` prints, cell by cell.
    rows = collect(store)
    shown = [
        [td.text for td in tr.find_elements(By.TAG_NAME, "td")]
        for tr in browser.find_elements(By.CSS_SELECTOR, "#evaluations tbody tr")
    ]
    assert shown == [[_cell(row, col) for col in COLUMNS] + [row["eval_id"]] for row in rows]
    arith_dpo = [r for r in shown if r[:3] == ["1", "dpo", "arith"]]
    assert arith_dpo[0][3] == "50.0% ± 14.4"  # 6 of 12 solved: sqrt(.25 / 12) = 0.144

    # A trajectory link opens its page: messages with their loss flags, and a way back.
    link = browser.find_element(By.CSS_SELECTOR, "#trajectory-links a.trajectory")
    assert link.text == "best"
    link.click()
    assert browser.current_url.endswith("/trajectories/round-1-arith-best.html")
    messages = browser.find_elements(By.CSS_SELECTOR, "li.msg")
    flags = [m.find_element(By.CSS_SELECTOR, ".loss").text for m in messages]
    assert len(messages) >= 5 and flags[:3] == ["not trained"] * 3
    assert flags.count("trained (loss on)") == len(
        browser.find_elements(By.CSS_SELECTOR, "li.msg.trained")
    )
    assert flags[-1] == "trained (loss on)"  # the answer turn
    browser.find_element(By.LINK_TEXT, "back to the report").click()
    assert browser.current_url == index.as_uri()


def rendered_plots(browser) -> list[dict]:
    """Each plot of the page, checked to have a size and its marks inside it; the success and
    distribution plots have drawn marks (a bar of a 0% difficulty has no height)."""
    plots = browser.execute_script(MEASURE)
    for plot in plots:
        assert plot["w"] > 100 and plot["h"] > 100, plot["figure"]
        assert plot["marks"] and all(m["inside"] for m in plot["marks"]), plot["figure"]
        drawn = [m for m in plot["marks"] if m["w"] > 0 and (m["h"] > 0 or m["tag"] == "line")]
        assert drawn or plot["figure"].startswith("success-by-difficulty"), plot["figure"]
    return plots


def test_the_report_flywheel_run_wrote_renders(browser, screenshot, tracked_run):
    """The report `flywheel run` wrote at its end (the tiny 2-round run, or the demo's with
    FLYWHEEL_SCREENSHOT_RUN): every plot drawn, the numbers those of its eval artifacts."""
    browser.get(tracked_run.report.as_uri())
    figures = {p["figure"] for p in rendered_plots(browser)}
    assert {"success-by-round-arith", "explore-reward", "pareto-front"} <= figures, figures
    rows = collect(tracked_run.store)
    shown = [
        [td.text for td in tr.find_elements(By.TAG_NAME, "td")]
        for tr in browser.find_elements(By.CSS_SELECTOR, "#evaluations tbody tr")
    ]
    assert shown == [[_cell(row, col) for col in COLUMNS] + [row["eval_id"]] for row in rows]
    for ref in [*tracked_run.evals.values(), *tracked_run.baselines.values()]:
        css = f"#success-by-round-arith .mark[data-eval-id='{ref.id}']"
        (mark,) = browser.find_elements(By.CSS_SELECTOR, css)
        assert float(mark.get_attribute("data-success")) == ref.summary["arith/success_rate"]
    screenshot("html-report")


def test_links_work_from_a_web_server(browser, server):
    browser.get(f"{server}/index.html")
    links = browser.find_elements(By.CSS_SELECTOR, "#trajectory-links a.trajectory")
    hrefs = [a.get_attribute("href") for a in links]
    assert len(hrefs) == 2 * 2 * 2 + 2 and all(
        h.startswith(f"{server}/trajectories/") for h in hrefs
    )
    revised = [a for a in links if a.text.startswith("revised")]
    assert [a.text for a in revised] == ["revised 1", "revised 2"]  # round 2, arith
    target = revised[-1].get_attribute("href")
    revised[-1].click()
    assert browser.current_url == target
    assert "revised trajectory" in browser.find_element(By.TAG_NAME, "h1").text
    assert browser.find_elements(By.CSS_SELECTOR, "li.msg.trained")
