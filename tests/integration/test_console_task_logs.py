"""The console's task log: per task and attempt, beside the traceback, polled while running."""

from __future__ import annotations

import json

import pytest

from agents.sandbox.task_log import TaskLog
from fleet.engine import task_logs
from fleet.engine.claims import claim_task
from fleet.models import TaskAttemptLog
from tests.support.console import HX
from tests.support.factories import finish, start, two_task_package

pytestmark = pytest.mark.django_db


@pytest.fixture
def execution(tenant):
    two_task_package(tenant, retries=1)
    execution, _tasks = start(tenant, "demo")
    return execution


def panel_url(execution, task: str = "a", query: str = "") -> str:
    return f"/console/executions/{execution.pk}/tasks/{task}/log/partials/panel/{query}"


def task_a(execution):
    return execution.tasks.get(task_name="a")


def test_a_finished_tasks_log_shows_without_polling(reader_client, execution):
    finish(task_a(execution), output={}, log=TaskLog("hello from a\n<b>not bold</b>\n", 29, 0))
    response = reader_client.get(panel_url(execution), **HX)
    assert response.status_code == 200
    body = response.content.decode()
    assert "hello from a" in body
    assert "&lt;b&gt;not bold&lt;/b&gt;" in body  # tenant output is text, never markup
    assert 'data-running="false"' in body and "hx-trigger" not in body
    # No hx-get either: without a trigger htmx reloads the panel on any click inside it.
    assert "hx-get" not in body
    assert "attempt 1 of 1" in body and "success" in body


def test_a_failed_attempt_shows_its_traceback_beside_its_log(reader_client, execution):
    finish(
        task_a(execution), "failure", error_type="KeyError", error_message="'x'",
        traceback="Traceback (most recent call last):\n  KeyError: 'x'", log=TaskLog("before\n", 7, 0),
    )  # fmt: skip
    body = reader_client.get(panel_url(execution, query="?attempt=1"), **HX).content.decode()
    assert '<pre class="log" id="task-log-text">before\n</pre>' in body
    assert 'id="task-log-traceback">Traceback (most recent call last):' in body
    assert "failure" in body


def test_a_running_attempt_polls_and_shows_its_live_tail(reader_client, execution, tenant):
    claim = claim_task(task_a(execution).pk, "test")
    live = task_logs.LiveChunk(claim.task_execution_id, claim.assignment, "step 1 of 3\n", 12)
    assert task_logs.append_live(live, tenant.pk)
    body = reader_client.get(panel_url(execution), **HX).content.decode()
    assert "step 1 of 3" in body
    assert 'data-running="true"' in body and 'hx-trigger="every 2s"' in body


def test_each_attempt_is_reachable_and_the_latest_is_the_default(reader_client, execution):
    task = task_a(execution)
    finish(task, "failure", error_type="E", traceback="first trace", log=TaskLog("one\n", 4, 0))
    # The second attempt, recorded as the result handler would have.
    task.refresh_from_db()
    task.attempt, task.status = 2, "Completed"
    task.save(update_fields=["attempt", "status"])
    TaskAttemptLog.objects.create(
        task_execution=task, attempt=2, assignment=2, text="two\n", bytes=4, finished=True
    )
    latest = reader_client.get(panel_url(execution), **HX).content.decode()
    assert "two\n" in latest and "attempt 2 of 2" in latest and "first trace" not in latest
    assert 'aria-current="true" class="current">#2' in latest
    # Choosing an attempt aborts a poll of the panel in flight (it would land after).
    assert latest.count('hx-sync="#task-log:replace"') == 2
    first = reader_client.get(panel_url(execution, query="?attempt=1"), **HX).content.decode()
    assert "one\n" in first and "first trace" in first


@pytest.mark.parametrize(
    ("query", "status", "detail"),
    [
        ("?attempt=x", 400, "attempt must be a whole number from 1, got 'x'"),
        ("?attempt=0", 400, "attempt must be a whole number from 1, got '0'"),
        ("?attempt=9", 404, "task 'a' has not run an attempt 9"),
    ],
)
def test_a_bad_attempt_is_refused_naming_it(reader_client, execution, query, status, detail):
    finish(task_a(execution), output={}, log=TaskLog("x\n", 2, 0))
    response = reader_client.get(panel_url(execution, query=query), **HX)
    assert response.status_code == status
    assert json.loads(response.content)["detail"] == detail


def test_a_task_not_run_yet_says_so(reader_client, execution):
    body = reader_client.get(panel_url(execution, "b"), **HX).content.decode()
    assert "b has not run yet (NotStarted)" in body


def test_an_unknown_task_is_a_404(reader_client, execution):
    response = reader_client.get(panel_url(execution, "nope"), **HX)
    assert response.status_code == 404


def test_the_execution_page_links_each_run_task_to_its_log(reader_client, execution):
    finish(task_a(execution), output={}, log=TaskLog("x\n", 2, 0))
    body = reader_client.get(f"/console/executions/{execution.pk}/").content.decode()
    assert f'hx-get="/console/executions/{execution.pk}/tasks/a/log/partials/panel/"' in body
    assert 'hx-target="#task-log"' in body and '<section id="task-log"' in body
    assert 'hx-target="#task-log" hx-swap="outerHTML" hx-sync="#task-log:replace"' in body
    assert f"/console/executions/{execution.pk}/tasks/b/log/" not in body  # b has not run


def test_the_log_page_stands_alone_with_a_way_back(reader_client, execution):
    finish(task_a(execution), output={}, log=TaskLog("alone\n", 6, 0))
    body = reader_client.get(f"/console/executions/{execution.pk}/tasks/a/log/").content.decode()
    assert "alone" in body and f'href="/console/executions/{execution.pk}/"' in body


def test_a_truncated_log_says_how_much_was_dropped(reader_client, execution):
    finish(task_a(execution), output={}, log=TaskLog("tail\n", 300_000, 299_995))
    body = reader_client.get(panel_url(execution), **HX).content.decode()
    assert "[… 299995 bytes truncated …]\ntail" in body
    assert "only the last part is kept" in body


def test_another_tenants_task_log_is_a_404(outsider_client, execution):
    finish(task_a(execution), output={}, log=TaskLog("private\n", 8, 0))
    response = outsider_client.get(panel_url(execution), **HX)
    assert response.status_code == 404
    assert b"private" not in response.content
