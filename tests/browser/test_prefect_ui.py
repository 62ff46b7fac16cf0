"""The Prefect UI after a deployment run: a Prefect server on 127.0.0.1 with the deployments of
prefect.yaml, ``prefect deployment run 'stage/default' -p name=expert`` on tiny arith tasks
through a worker, then the flow run's page in headless Chromium: its stage (task) runs, and the
progress and status lines of flywheel.progress in its logs, under the task run that wrote them.

    .venv/bin/python -m pytest tests/browser/test_prefect_ui.py -q
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from flywheel import progress
from tests.browser.prefect_helpers import (
    flow_run,
    logs,
    prefect_server,
    run_deployment,
    run_worker_once,
    task_runs,
)

TINY = (
    "envs.arith.n_train=8",
    "envs.arith.n_val=2",
    "envs.arith.n_test=4",
    "tracking.enabled=false",
)


def _body(browser) -> str:
    return browser.find_element(By.TAG_NAME, "body").text


def _innermost(text: str) -> str:
    """XPath of the deepest elements whose text contains ``text`` (the UI splits text nodes)."""
    has = f"contains(., '{text}')"
    return f"//*[{has} and not(*[{has}])]"


def _wait_for(browser, *texts: str, timeout: float = 60.0) -> str:
    WebDriverWait(browser, timeout).until(lambda b: all(t in _body(b) for t in texts))
    return _body(browser)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_flow_run_page_shows_stage_runs_and_their_progress_lines(
    browser, screenshot, tmp_path: Path, monkeypatch
) -> None:
    # A line per episode, so the progress lines (rate, ETA) show up in a run of seconds.
    monkeypatch.setenv(progress.SECONDS_ENV, "0")
    overrides = [f"run.work_dir={tmp_path / 'work'}", *TINY]
    with prefect_server(tmp_path / "prefect-home") as (url, home):
        run_id = run_deployment(
            url, home, tmp_path, "stage/default", name="expert", round=0, overrides=overrides
        )
        worker_log = tmp_path / "worker.log"
        run_worker_once(url, home, worker_log)
        printed = worker_log.read_text()
        assert flow_run(url, run_id)["state"]["type"] == "COMPLETED", printed[-4000:]

        # What the API holds: the two stage runs, and our lines under the right runs.
        stages = {t["name"]: t for t in task_runs(url, run_id)}
        assert set(stages) == {"tasks-round-0", "expert-round-0"}
        ours = [log for log in logs(url, run_id) if log["name"] == progress.LOGGER]
        expert_id = stages["expert-round-0"]["id"]
        summary = "expert: arith train: 8 trajectories, oracle success 100.0%"
        by_message = {log["message"]: log for log in ours}
        assert by_message[summary]["task_run_id"] == expert_id
        rates = [m for m in by_message if re.match(r"expert: arith train: \d/8 episodes", m)]
        assert len(rates) == 8, sorted(by_message)
        stage_lines = [m for m in by_message if m.startswith("[round 0] ")]
        assert [m.split()[2] for m in stage_lines] == ["tasks"] * 3 + ["expert"]
        assert all(by_message[m]["task_run_id"] is None for m in stage_lines)  # the flow's own
        # the worker's terminal shows each line once: no copy from Prefect's console logging
        assert all(printed.count(log["message"]) == 1 for log in ours), printed[-4000:]

        # The flow run's page: its logs tab (the default) lists every one of our lines.
        browser.set_window_size(1400, 2100)  # the graph of stage runs and every log line
        browser.get(f"{url}/runs/flow-run/{run_id}")
        text = _wait_for(browser, summary, "[round 0] expert")
        flat = " ".join(text.split())
        for log in ours:
            assert " ".join(log["message"].split()) in flat, log["message"]
        assert re.search(
            r"expert: arith train: 8/8 episodes \(100%\), [\d.]+ episodes/s, took 0:\d\d", text
        )
        # a line written inside a stage is shown with its stage (task) run's name
        assert re.search(re.escape(summary) + r"\n[\d:]+ [AP]M\nexpert-round-0\n", text), text
        assert "Can't connect to Server API" not in text
        # served by the server itself: no request left 127.0.0.1:<port> (no CDN)
        loaded = browser.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)"
        )
        assert loaded and all(name.startswith(url) for name in loaded), loaded
        screenshot("prefect-flow-run")

        # The task runs tab names both stage runs, completed.
        browser.find_element(By.XPATH, _innermost("Task Runs")).click()
        text = _wait_for(browser, "expert-round-0", "tasks-round-0")
        assert text.count("Completed") >= 3  # the flow run's badge and both task runs
