"""A task's log in the console, in real Chromium: per attempt beside the traceback, tailed live.

The logs are real: the etl-demo tasks run in a real task runner child (so the output and
the traceback are what a task really prints), and their outcomes go through the result
handler.  The screenshot goes to docs/screenshots/task-log.png with
CLOACINA_SCREENSHOT_DIR=docs/screenshots (see docs/console.md).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from agents.sandbox.task_log import TaskLog
from agents.sandbox.task_runner import TaskRunner
from fleet.engine import task_logs
from fleet.engine.claims import claim_task
from fleet.engine.results import TaskReport, result_handler
from fleet.executors.inprocess import report_for
from fleet.models import TaskExecution
from tests.support.browser import login
from tests.support.console import PASSWORD, with_password
from tests.support.factories import publish_example, start, tasks_of
from tests.support.loop import run_async

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

LIVE_UPDATE_S = 5  # the panel polls every 0.5 s here (fast_polling); allow for a busy machine
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "etl-demo"


def _run_for_real(runner: TaskRunner, package_dir: Path, task: TaskExecution, context: dict):
    """Claim ``task``, run its function in a real child and record the outcome with its log."""
    claim = claim_task(task.pk, "browser-test")
    assert claim is not None, task.task_name
    outcome = run_async(
        runner.run(package_dir, claim.function, json.dumps(context), claim.timeout_s)
    )
    result_handler.apply(report_for(claim, outcome))
    return outcome


def _scene(tenant, tmp_path: Path) -> TaskExecution:
    """etl-demo with fail_once: extract fails (log + traceback), succeeds on its retry,
    transform_a is running with part of its output in."""
    publish_example(tenant)
    package_dir = tmp_path / "etl-demo"
    shutil.copytree(EXAMPLE, package_dir)
    context = {"fail_once": True, "marker_path": str(tmp_path / "marker")}
    execution, tasks = start(tenant, "etl", context)
    with TaskRunner(1) as runner:
        first = _run_for_real(runner, package_dir, tasks["extract"], context)
        assert first.status == "failure" and "TransientExtractError" in first.traceback
        TaskExecution.objects.filter(pk=tasks["extract"].pk).update(ready_at=timezone.now())
        second = _run_for_real(runner, package_dir, tasks_of(execution)["extract"], context)
        assert second.status == "success", second
    return execution


def test_a_tasks_log_per_attempt_beside_its_traceback_tailed_live(
    page, live_server, writer_user, tenant, tmp_path, screenshot_dir
):
    execution = _scene(tenant, tmp_path)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    login(page, live_server, with_password(writer_user).username, PASSWORD)
    page.goto(f"{live_server.url}/console/executions/{execution.pk}/")
    page.wait_for_function("window.htmx !== undefined")

    # The latest attempt of extract by default: what it printed and logged.
    page.locator("article[data-task=extract] a.task-log-link").click()
    panel = page.locator("#task-log[data-task=extract]")
    expect(panel).to_contain_text("attempt 2 of 2")
    expect(page.locator("#task-log-text")).to_contain_text("extracted 3 rows")
    expect(page.locator("#task-log-text")).to_contain_text("INFO etl_demo: rows: [1, 2, 3]")
    expect(page.locator("#task-log-traceback")).to_have_count(0)

    # The failed first attempt: its log, and its real traceback beside it.  The click asks
    # for attempt 1 and nothing else: a finished panel once kept an hx-get with htmx's
    # default trigger (click), so the same click also reloaded attempt 2 and, about one run
    # in three, that answer landed last and the switch was lost.
    panel_requests: list[str] = []
    page.on(
        "request",
        lambda req: panel_requests.append(req.url) if "/log/partials/panel/" in req.url else None,
    )
    page.wait_for_function(
        """() => {
            const a = [...document.querySelectorAll('#task-log nav.attempts a')]
                .find(e => e.textContent.trim() === '#1');
            return a && a['htmx-internal-data'] !== undefined;
        }"""
    )
    panel.locator("nav.attempts a", has_text="#1").click()
    # The swap waits for the live server, which also answers the page's graph polls.
    expect(page.locator("#task-log[data-attempt='1']")).to_be_visible(timeout=20_000)
    assert [url.rsplit("?", 1)[-1] for url in panel_requests] == ["attempt=1"], panel_requests
    expect(page.locator("#task-log-text")).to_contain_text(
        "WARNING etl_demo: first attempt: failing on purpose (fail_once)"
    )
    trace = page.locator("#task-log-traceback")
    expect(trace).to_contain_text("Traceback (most recent call last):")
    expect(trace).to_contain_text("TransientExtractError: simulated transient failure")
    log_box, trace_box = page.locator("#task-log-text").bounding_box(), trace.bounding_box()
    assert trace_box["x"] > log_box["x"] + log_box["width"] - 1  # beside, not below
    page.screenshot(path=str(screenshot_dir / "task-log.png"), full_page=True)

    # transform_a runs: its panel tails the output as it comes, then stops polling.
    transform = tasks_of(execution)["transform_a"]
    claim = claim_task(transform.pk, "browser-test")
    chunk = task_logs.LiveChunk(transform.pk, claim.assignment, "summing 3 rows\n", 15)
    assert task_logs.append_live(chunk, tenant.pk)
    page.reload()
    page.locator("article[data-task=transform_a] a.task-log-link").click()
    live = page.locator("#task-log[data-task=transform_a]")
    expect(live).to_have_attribute("data-running", "true")
    expect(page.locator("#task-log-text")).to_have_text("summing 3 rows\n")
    more = task_logs.LiveChunk(transform.pk, claim.assignment, "halfway\n", 23)
    assert task_logs.append_live(more, tenant.pk)
    expect(page.locator("#task-log-text")).to_have_text(
        "summing 3 rows\nhalfway\n", timeout=LIVE_UPDATE_S * 1000
    )
    result_handler.apply(
        TaskReport(transform.pk, claim.assignment, "success", output={"sum": 6},
                   log=TaskLog("summing 3 rows\nhalfway\ndone: 6\n", 31, 0))
    )  # fmt: skip
    expect(live).to_have_attribute("data-running", "false", timeout=LIVE_UPDATE_S * 1000)
    expect(page.locator("#task-log-text")).to_have_text("summing 3 rows\nhalfway\ndone: 6\n")
    assert page.locator("#task-log").get_attribute("hx-trigger") is None  # polling stopped
    assert errors == []
