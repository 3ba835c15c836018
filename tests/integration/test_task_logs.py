"""Task logs: stored per attempt with the outcome, tailed live, pruned, served over REST."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from agents.sandbox.task_log import TaskLog
from fleet.engine import task_logs
from fleet.engine.claims import claim_task
from fleet.engine.results import TaskReport, result_handler
from fleet.models import TaskAttemptLog, TaskExecution
from fleet.platform.config import apply_overrides, reset_config
from tests.support.factories import start, two_task_package
from tests.support.keys import bearer

# Claims compare ready_at with the database's now(): a wrapping transaction would freeze it.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def execution(tenant):
    two_task_package(tenant, retries=2)
    execution, _tasks = start(tenant, "demo")
    return execution


def task(execution, name: str = "a") -> TaskExecution:
    return TaskExecution.objects.get(workflow_execution=execution, task_name=name)


def run(execution, outcome: str = "success", log: TaskLog | None = None, **report):
    """Claim task ``a`` and report one outcome with ``log``; returns the claim."""
    claim = claim_task(task(execution).pk, "test")
    assert claim is not None
    result_handler.apply(
        TaskReport(claim.task_execution_id, claim.assignment, outcome, log=log, **report)
    )
    return claim


def logs_url(execution, name: str = "a", query: str = "") -> str:
    return f"/api/v1/executions/{execution.pk}/tasks/{name}/logs{query}"


# -- storage ------------------------------------------------------------------------------


def test_an_outcome_stores_its_attempts_log(execution):
    run(execution, log=TaskLog("hello\n", 6, 0), output={"a": 1})
    entry = TaskAttemptLog.objects.get()
    assert (entry.task_execution_id, entry.attempt) == (task(execution).pk, 1)
    assert (entry.text, entry.bytes, entry.truncated_bytes, entry.finished) == (
        "hello\n",
        6,
        0,
        True,
    )


def test_the_server_keeps_its_own_bound_on_an_outcomes_log(execution):
    """An agent configured with a bigger ring (or a hostile one) cannot store more than the
    server's CLOACINA_TASK_LOG_BYTES: the front is dropped and counted, whole characters kept."""
    apply_overrides(task_log_bytes=1000)
    try:
        text = "é" * 800 + "end\n"  # 1,604 bytes
        run(execution, log=TaskLog(text, 5000, 3396), output={})
        entry = TaskAttemptLog.objects.get()
        assert len(entry.text.encode()) <= 1000 and entry.text.endswith("é" * 10 + "end\n")
        assert entry.bytes == 5000
        assert entry.truncated_bytes == 5000 - len(entry.text.encode())
    finally:
        reset_config()


def test_a_silent_success_costs_no_row(execution):
    run(execution, log=TaskLog("", 0, 0), output={})
    assert not TaskAttemptLog.objects.exists()


def test_each_attempt_keeps_its_own_log_and_traceback(execution):
    run(execution, "failure", TaskLog("try 1\n", 6, 0), error_type="E", traceback="Trace 1")
    TaskExecution.objects.filter(pk=task(execution).pk).update(ready_at=timezone.now())
    run(execution, "failure", TaskLog("try 2\n", 6, 0), error_type="E", traceback="Trace 2")
    TaskExecution.objects.filter(pk=task(execution).pk).update(ready_at=timezone.now())
    run(execution, log=TaskLog("try 3\n", 6, 0), output={})
    by_attempt = task_logs.attempt_logs(task(execution).pk)
    assert {n: (e.text, e.traceback) for n, e in by_attempt.items()} == {
        1: ("try 1\n", "Trace 1"),
        2: ("try 2\n", "Trace 2"),
        3: ("try 3\n", ""),
    }


def test_a_stale_outcome_does_not_overwrite_the_log(execution):
    claim = run(execution, log=TaskLog("real\n", 5, 0), output={})
    result_handler.apply(
        TaskReport(claim.task_execution_id, claim.assignment, "success", log=TaskLog("dup", 3, 0))
    )
    assert TaskAttemptLog.objects.get().text == "real\n"


def test_nul_characters_are_stored_replaced(execution):
    run(execution, log=TaskLog("a\x00b", 3, 0), output={})
    assert TaskAttemptLog.objects.get().text == "a\ufffdb"


# -- live chunks --------------------------------------------------------------------------


def live(claim, text: str, end: int, skipped: int = 0) -> task_logs.LiveChunk:
    return task_logs.LiveChunk(claim.task_execution_id, claim.assignment, text, end, skipped)


def test_live_chunks_build_the_running_attempts_log_and_the_outcome_replaces_it(execution, tenant):
    claim = claim_task(task(execution).pk, "test")
    assert task_logs.append_live(live(claim, "one\n", 4), tenant.pk)
    assert task_logs.append_live(live(claim, "two\n", 8), tenant.pk)
    entry = TaskAttemptLog.objects.get()
    assert (entry.text, entry.bytes, entry.finished) == ("one\ntwo\n", 8, False)
    # A repeated (stale) chunk changes nothing.
    assert not task_logs.append_live(live(claim, "two\n", 8), tenant.pk)
    result_handler.apply(
        TaskReport(claim.task_execution_id, claim.assignment, "success", output={},
                   log=TaskLog("one\ntwo\nthree\n", 14, 0))
    )  # fmt: skip
    entry.refresh_from_db()
    assert (entry.text, entry.bytes, entry.finished) == ("one\ntwo\nthree\n", 14, True)
    # After the outcome, a late chunk does not count.
    assert not task_logs.append_live(live(claim, "late\n", 20), tenant.pk)
    entry.refresh_from_db()
    assert entry.text == "one\ntwo\nthree\n"


def test_live_chunks_stay_bounded_and_mark_what_was_dropped(execution, tenant):
    apply_overrides(task_log_bytes=1024)
    try:
        claim = claim_task(task(execution).pk, "test")
        for i in range(1, 11):
            assert task_logs.append_live(live(claim, "x" * 299 + "\n", 300 * i), tenant.pk)
        entry = TaskAttemptLog.objects.get()
        assert len(entry.text) == 1024
        assert (entry.bytes, entry.truncated_bytes) == (3000, 3000 - 1024)
        # A chunk that skipped bytes (the ring overran) replaces the text.
        assert task_logs.append_live(live(claim, "tail\n", 9000, skipped=5000), tenant.pk)
        entry.refresh_from_db()
        assert (entry.text, entry.bytes, entry.truncated_bytes) == ("tail\n", 9000, 8995)
        assert task_logs.rendered(entry) == "[… 8995 bytes truncated …]\ntail\n"
    finally:
        reset_config()


def test_live_chunks_are_fenced_on_tenant_assignment_and_agent(execution, tenant, other_tenant):
    claim = claim_task(task(execution).pk, "test")
    assert not task_logs.append_live(live(claim, "x", 1), other_tenant.pk)
    stale = task_logs.LiveChunk(claim.task_execution_id, claim.assignment + 1, "x", 1)
    assert not task_logs.append_live(stale, tenant.pk)
    assert not task_logs.append_live(live(claim, "x", 1), tenant.pk, agent_id=uuid.uuid4())
    assert not TaskAttemptLog.objects.exists()


# -- retention ----------------------------------------------------------------------------


def test_logs_older_than_the_retention_are_pruned(execution):
    run(execution, log=TaskLog("old\n", 4, 0), output={})
    entry = TaskAttemptLog.objects.get()
    TaskAttemptLog.objects.filter(pk=entry.pk).update(
        updated_at=timezone.now() - timedelta(days=15)
    )
    b = task(execution, "b")
    TaskAttemptLog.objects.create(task_execution=b, attempt=1, assignment=1, text="new\n")
    apply_overrides(task_log_retention_days=14)
    try:
        assert task_logs.prune_logs() == 1
        assert list(TaskAttemptLog.objects.values_list("text", flat=True)) == ["new\n"]
        apply_overrides(task_log_retention_days=0)  # 0 keeps them for ever
        assert task_logs.prune_logs(timezone.now() + timedelta(days=1000)) == 0
    finally:
        reset_config()


def test_pruning_is_a_leader_only_periodic_job():
    (job,) = task_logs.task_log_jobs()
    assert job.name == "task_log_prune" and job.leader_only
    assert job.func is task_logs.prune_logs


# -- REST ---------------------------------------------------------------------------------


def test_rest_serves_the_latest_attempt_as_plain_text(execution, read_key):
    run(execution, "failure", TaskLog("first\n", 6, 0), error_type="E", traceback="T")
    TaskExecution.objects.filter(pk=task(execution).pk).update(ready_at=timezone.now())
    run(execution, log=TaskLog("second\n", 7, 0), output={})
    response = Client().get(logs_url(execution), **bearer(read_key))
    assert response.status_code == 200
    assert response["Content-Type"] == "text/plain; charset=utf-8"
    assert response.content.decode() == "second\n"
    assert response["X-Cloacina-Attempt"] == "2"
    assert response["X-Cloacina-Log-Finished"] == "true"
    first = Client().get(logs_url(execution, query="?attempt=1"), **bearer(read_key))
    assert first.content.decode() == "first\n"
    assert first["X-Cloacina-Attempt"] == "1"


def test_rest_marks_a_truncated_log(execution, read_key):
    run(execution, log=TaskLog("the tail\n", 5000, 4991), output={})
    response = Client().get(logs_url(execution), **bearer(read_key))
    assert response.content.decode() == "[… 4991 bytes truncated …]\nthe tail\n"
    assert response["X-Cloacina-Log-Bytes"] == "5000"
    assert response["X-Cloacina-Log-Truncated-Bytes"] == "4991"


def test_rest_shows_a_running_attempts_live_log(execution, tenant, read_key):
    claim = claim_task(task(execution).pk, "test")
    task_logs.append_live(live(claim, "so far\n", 7), tenant.pk)
    response = Client().get(logs_url(execution), **bearer(read_key))
    assert response.content.decode() == "so far\n"
    assert response["X-Cloacina-Log-Finished"] == "false"


def test_an_attempt_that_printed_nothing_is_an_empty_text(execution, read_key):
    run(execution, log=TaskLog("", 0, 0), output={})
    response = Client().get(logs_url(execution), **bearer(read_key))
    assert (response.status_code, response.content) == (200, b"")


@pytest.mark.parametrize(
    ("query", "status", "detail"),
    [
        ("?attempt=0", 422, "attempt"),
        ("?attempt=-1", 422, "attempt"),
        ("?attempt=two", 422, "attempt"),
        ("?attempt=1.5", 422, "attempt"),
        ("?attempt=3", 404, "task 'a' has no attempt 3: it has run 1 attempt"),
    ],
)
def test_rest_refuses_a_bad_attempt_with_json(execution, read_key, query, status, detail):
    run(execution, log=TaskLog("x\n", 2, 0), output={})
    response = Client().get(logs_url(execution, query=query), **bearer(read_key))
    assert response.status_code == status
    assert response["Content-Type"].startswith("application/json")
    assert detail in response.json()["detail"]


def test_rest_404s_unknown_tasks_and_tasks_not_run_yet(execution, read_key):
    missing = Client().get(logs_url(execution, "nope"), **bearer(read_key))
    assert missing.status_code == 404
    assert missing.json()["detail"] == f"execution {execution.pk} has no task 'nope'"
    not_run = Client().get(logs_url(execution, "b"), **bearer(read_key))
    assert not_run.status_code == 404
    assert not_run.json()["detail"] == "task 'b' has not run yet (it is NotStarted)"


def test_rest_is_tenant_scoped(execution, other_write_key):
    run(execution, log=TaskLog("acme's secret\n", 14, 0), output={})
    response = Client().get(logs_url(execution), **bearer(other_write_key))
    assert response.status_code == 404
    assert response.json() == {"detail": f"execution {execution.pk} not found"}
    assert b"secret" not in response.content


def test_rest_needs_a_key(execution):
    assert Client().get(logs_url(execution)).status_code == 401
