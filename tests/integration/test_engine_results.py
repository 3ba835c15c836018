"""The result handler: fencing, idempotency, output validation, refusals."""

from __future__ import annotations

import math
import threading

import pytest
from django.db import connections

from fleet.engine.claims import claim_task
from fleet.engine.events import ExecutionStatus
from fleet.engine.results import MAX_REFUSALS, TaskReport, result_handler
from fleet.models import Outcome, TaskExecution, TaskOutcome, TaskStatus
from fleet.platform.config import apply_overrides, reset_config
from tests.support.factories import make_package, start

SOURCE = "def f(ctx):\n    return {}\n"


def running_task(tenant, **task_fields):
    """A one-task execution whose task is claimed (Running); returns (task, claim)."""
    make_package(tenant, [{"id": "a", "function": "demo.steps:f", **task_fields}], SOURCE)
    _, tasks = start(tenant, "demo", {"in": 1})
    return tasks["a"], claim_task(tasks["a"].pk, "test")


def outcomes(task) -> list[tuple]:
    return list(
        TaskOutcome.objects.filter(task_execution=task)
        .order_by("id")
        .values_list("assignment", "outcome", "applied", "ignored_reason")
    )


@pytest.mark.django_db
def test_a_stale_assignment_is_recorded_but_not_applied(tenant):
    task, claim = running_task(tenant)
    stale = TaskReport(task.pk, claim.assignment - 1, Outcome.SUCCESS, {"late": True})
    applied = result_handler.apply(stale)
    assert (applied.applied, applied.status) == (False, ExecutionStatus.SUPERSEDED)
    assert applied.reason == "assignment 0 is not current (1)"
    task.refresh_from_db()
    assert task.status == TaskStatus.RUNNING and task.output_context is None
    assert outcomes(task) == [(0, "success", False, "assignment 0 is not current (1)")]
    # The current assignment still applies afterwards.
    assert result_handler.apply(TaskReport(task.pk, claim.assignment, "success", {"ok": 1})).applied


@pytest.mark.django_db
def test_a_duplicate_success_does_not_complete_twice(tenant):
    task, claim = running_task(tenant)
    report = TaskReport(task.pk, claim.assignment, Outcome.SUCCESS, {"n": 1})
    first = result_handler.apply(report)
    second = result_handler.apply(TaskReport(task.pk, claim.assignment, "success", {"n": 2}))
    assert (first.applied, first.status) == (True, ExecutionStatus.COMPLETED)
    assert (second.applied, second.status) == (False, ExecutionStatus.SUPERSEDED)
    assert second.reason == "task is Completed, not Running"
    task.refresh_from_db()
    assert task.output_context == {"n": 1}
    assert TaskOutcome.objects.filter(task_execution=task, applied=True).count() == 1
    assert task.workflow_execution.final_context == {"in": 1, "n": 1}


@pytest.mark.django_db(transaction=True)
def test_concurrent_duplicates_apply_exactly_once(tenant):
    task, claim = running_task(tenant)
    barrier = threading.Barrier(4)
    results = []

    def report(n: int) -> None:
        try:
            barrier.wait()
            results.append(
                result_handler.apply(TaskReport(task.pk, claim.assignment, "success", {"n": n}))
            )
        finally:
            connections.close_all()

    threads = [threading.Thread(target=report, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(r.applied for r in results) == [False, False, False, True]
    assert TaskOutcome.objects.filter(task_execution=task, applied=True).count() == 1


@pytest.mark.django_db
def test_an_outcome_from_an_agent_that_no_longer_holds_the_task_is_ignored(tenant):
    import uuid

    task, claim = running_task(tenant)
    applied = result_handler.apply(
        TaskReport(task.pk, claim.assignment, "success", {}, agent_id=uuid.uuid4(), agent_name="x")
    )
    assert not applied.applied
    assert applied.reason == "the task is no longer assigned to this agent"
    assert outcomes(task)[0][2:] == (False, "the task is no longer assigned to this agent")


@pytest.mark.django_db
def test_an_unknown_task_is_superseded(db):
    import uuid

    applied = result_handler.apply(TaskReport(uuid.uuid4(), 1, "success", {}))
    assert (applied.applied, applied.reason) == (False, "unknown task execution")


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("output", "message"),
    [
        ([1, 2], "task output must be a JSON object, got list"),
        ({"x": math.nan}, "task output is not valid JSON"),
        ({"x": {1, 2}}, "task output is not JSON-serialisable"),
    ],
)
def test_invalid_output_fails_the_task(tenant, output, message):
    task, claim = running_task(tenant)
    applied = result_handler.apply(TaskReport(task.pk, claim.assignment, "success", output))
    assert (applied.applied, applied.status) == (True, ExecutionStatus.FAILED)
    task.refresh_from_db()
    assert (task.status, task.error_type) == ("Failed", "InvalidTaskOutput")
    assert task.error_message.startswith(message)
    assert task.output_context is None
    # Recorded as what it became: a failure.
    assert outcomes(task) == [(1, "failure", True, "")]


@pytest.mark.django_db
def test_output_over_the_context_limit_fails_the_task(tenant):
    task, claim = running_task(tenant)
    apply_overrides(max_context_bytes=100)
    try:
        applied = result_handler.apply(
            TaskReport(task.pk, claim.assignment, "success", {"blob": "x" * 200})
        )
    finally:
        reset_config()
    assert applied.status == ExecutionStatus.FAILED
    task.refresh_from_db()
    assert task.error_type == "InvalidTaskOutput"
    assert "over the 100-byte limit" in task.error_message


@pytest.mark.django_db
def test_none_output_is_stored_as_an_empty_object(tenant):
    task, claim = running_task(tenant)
    result_handler.apply(TaskReport(task.pk, claim.assignment, "success", None))
    task.refresh_from_db()
    assert task.output_context == {}


@pytest.mark.django_db
def test_a_refusal_requeues_without_using_an_attempt(tenant):
    task, claim = running_task(tenant, retries=0)
    applied = result_handler.apply(
        TaskReport(task.pk, claim.assignment, Outcome.REFUSED, error_message="wrong triple")
    )
    assert (applied.applied, applied.status) == (True, ExecutionStatus.REQUEUED)
    assert [e.attempt for e in applied.ready] == [1]
    task.refresh_from_db()
    assert (task.status, task.attempt, task.refusals) == ("Ready", 0, 1)
    assert "wrong triple" in task.wait_reason


@pytest.mark.django_db
def test_too_many_refusals_fail_the_task(tenant):
    task, _ = running_task(tenant)
    TaskExecution.objects.filter(pk=task.pk).update(refusals=MAX_REFUSALS - 1)
    task.refresh_from_db()
    applied = result_handler.apply(
        TaskReport(task.pk, task.assignment, Outcome.REFUSED, error_message="no")
    )
    assert applied.status == ExecutionStatus.FAILED
    task.refresh_from_db()
    assert (task.status, task.error_type) == ("Failed", "Refused")
