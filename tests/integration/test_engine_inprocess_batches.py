"""The in-process executor's batched database work: claims prepared together, outcomes
recorded together (one transaction), each exactly as if alone."""

from __future__ import annotations

import asyncio

import pytest

from fleet.engine import ready_queue
from fleet.engine.claims import claim_tasks
from fleet.engine.events import ExecutionStatus
from fleet.engine.outcome_batches import apply_reports
from fleet.engine.results import TaskReport
from fleet.models import Outcome, TaskExecution, TaskOutcome, WorkflowExecution
from tests.support.factories import make_package, start
from tests.support.inprocess import initial_events, running_executor
from tests.support.loop import run_async

NOOP = "def noop(context):\n    return {'done': True}\n"


def wide(tenant, width: int = 6, workflow: str = "wide") -> None:
    tasks = [{"id": f"t{i}", "function": "demo.steps:noop"} for i in range(width)]
    make_package(tenant, tasks, NOOP, name=workflow, workflow=workflow)


def success(claim) -> tuple:
    report = TaskReport(claim.task_execution_id, claim.assignment, Outcome.SUCCESS, output={})
    return claim.workflow_execution_id, report


@pytest.mark.django_db(transaction=True)
def test_runs_offered_together_are_claimed_and_recorded_in_batches(tenant, tmp_path):
    wide(tenant, width=8)
    execution, _ = start(tenant, "wide", {})
    events = initial_events(execution.pk)
    with running_executor(tmp_path / "cache", workers=4) as (executor, _sink):

        async def all_at_once():
            results = await asyncio.gather(*(executor.execute(e) for e in events))
            preparer, recorder = executor._batchers()
            return results, (preparer.batches, preparer.items), (recorder.batches, recorder.items)

        results, prepared, recorded = run_async(all_at_once())
    assert [r.status for r in results] == [ExecutionStatus.COMPLETED] * 8
    # Eight runs, four children: the claims and the outcomes shared transactions.
    assert prepared[1] == 8 and prepared[0] < 8
    assert recorded[1] == 8 and recorded[0] < 8
    assert WorkflowExecution.objects.get(pk=execution.pk).status == "Completed"
    assert TaskOutcome.objects.filter(applied=True).count() == 8
    outputs = list(TaskExecution.objects.values_list("output_context", flat=True))
    assert outputs == [{"done": True}] * 8


@pytest.mark.django_db
def test_a_batch_of_outcomes_is_applied_once_each_and_finishes_the_workflows(tenant, monkeypatch):
    wide(tenant, width=3, workflow="one")
    wide(tenant, width=2, workflow="two")
    offered = []
    monkeypatch.setattr(ready_queue, "submit", lambda events: offered.extend(events))
    first, _ = start(tenant, "one", {})
    second, _ = start(tenant, "two", {})
    claims = claim_tasks(list(TaskExecution.objects.values_list("pk", flat=True)), "s")
    applied = apply_reports([success(c) for c in claims])
    assert [a.status for a in applied] == [ExecutionStatus.COMPLETED] * 5
    assert TaskOutcome.objects.filter(applied=True).count() == 5
    assert set(WorkflowExecution.objects.values_list("status", flat=True)) == {"Completed"}
    assert {first.pk, second.pk} == set(WorkflowExecution.objects.values_list("pk", flat=True))


@pytest.mark.django_db
def test_an_outcome_failing_in_the_batch_sends_every_outcome_through_its_own_transaction(tenant):
    """No savepoint per outcome in a batch: one that hits a database error (a concurrent
    duplicate's unique violation) rolls the batch back, and each outcome is applied again
    alone, where the others apply and that one is reported as the duplicate it is."""
    wide(tenant, width=4)
    start(tenant, "wide", {})
    claims = claim_tasks(list(TaskExecution.objects.values_list("pk", flat=True)), "s")
    claims.sort(key=lambda c: str(c.task_execution_id))
    duplicate = claims[0]
    TaskOutcome.objects.create(
        task_execution_id=duplicate.task_execution_id, assignment=duplicate.assignment, attempt=1,
        outcome="success", applied=True,
    )  # fmt: skip
    applied = apply_reports([success(c) for c in claims])
    assert (applied[0].applied, applied[0].reason) == (False, "duplicate outcome")
    assert [a.status for a in applied[1:]] == [ExecutionStatus.COMPLETED] * 3
    assert TaskExecution.objects.filter(status="Completed").count() == 3
    assert TaskOutcome.objects.filter(applied=True).count() == 4


@pytest.mark.django_db
def test_a_stale_outcome_in_a_batch_is_recorded_not_applied(tenant):
    wide(tenant, width=2)
    start(tenant, "wide", {})
    claims = claim_tasks(list(TaskExecution.objects.values_list("pk", flat=True)), "s")
    workflow, current = success(claims[0])
    stale = TaskReport(claims[1].task_execution_id, claims[1].assignment + 5, Outcome.SUCCESS)
    applied = apply_reports([(workflow, current), (claims[1].workflow_execution_id, stale)])
    assert applied[0].status == ExecutionStatus.COMPLETED
    assert applied[1].applied is False and "is not current" in applied[1].reason
    assert TaskExecution.objects.get(pk=claims[1].task_execution_id).status == "Running"


@pytest.mark.django_db(transaction=True)
def test_a_batch_of_successes_sends_its_begin_with_them(tenant):
    """The batch's BEGIN travels with its set of successes, and its COMMIT closes it: two
    round trips (before: BEGIN, the set, COMMIT)."""
    from tests.support.round_trips import RoundTrips  # local: only this test traces

    wide(tenant, width=3)
    start(tenant, "wide", {})
    claims = claim_tasks(list(TaskExecution.objects.values_list("pk", flat=True)), "s")
    with RoundTrips() as traced:
        applied = apply_reports([success(c) for c in claims[:2]])  # the execution stays open
    assert [a.status for a in applied] == [ExecutionStatus.COMPLETED] * 2
    trips = traced.trips()
    assert len(trips) == 2, trips
    assert trips[0].count("Execute") == 2  # BEGIN + the set of successes
    assert trips[1].count("Execute") == 1 and "Sync" in trips[1]  # COMMIT
    assert TaskExecution.objects.filter(status="Completed").count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_pipelined_batch_without_a_set_applies_each_outcome_on_its_own_path(tenant):
    """No set to send the BEGIN with (one current success, a stale one, a failure): the
    BEGIN goes alone and each outcome takes the per-row path (the ORM's row counts
    included) in the same transaction."""
    wide(tenant, width=3)
    start(tenant, "wide", {})
    claims = claim_tasks(list(TaskExecution.objects.values_list("pk", flat=True)), "s")
    workflow, current = success(claims[0])
    stale = TaskReport(claims[1].task_execution_id, claims[1].assignment + 5, Outcome.SUCCESS)
    failed = TaskReport(
        claims[2].task_execution_id, claims[2].assignment, Outcome.FAILURE, error_type="E"
    )
    applied = apply_reports(
        [(workflow, current), (workflow, stale), (claims[2].workflow_execution_id, failed)]
    )
    assert applied[0].status == ExecutionStatus.COMPLETED
    assert applied[1].applied is False and "is not current" in applied[1].reason
    assert applied[2].applied is True
    statuses = dict(TaskExecution.objects.values_list("pk", "status"))
    assert statuses[claims[0].task_execution_id] == "Completed"
    assert statuses[claims[1].task_execution_id] == "Running"
    assert statuses[claims[2].task_execution_id] == "Failed"
    assert TaskOutcome.objects.filter(applied=True).count() == 2
