"""Claims: one atomic statement per claim, so two claimers never get the same task."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from fleet.engine.claims import (
    RESULT_GRACE_S,
    claim_ready_tasks,
    claim_task,
    due_ready_task_events,
    release_claim,
)
from fleet.models import TaskExecution, TaskStatus, WorkflowExecution, WorkflowStatus
from tests.support.factories import make_package, start
from tests.support.racing import race

SOURCE = "def f(ctx):\n    return {}\n"


def one_task_execution(tenant, **task_fields):
    make_package(tenant, [{"id": "a", "function": "demo.steps:f", **task_fields}], SOURCE)
    execution, tasks = start(tenant, "demo")
    return execution, tasks["a"]


def many_ready_tasks(tenant, count: int) -> list[uuid.UUID]:
    """``count`` Ready tasks in one execution (rows written directly: a manifest this big is not the point)."""
    execution, first = one_task_execution(tenant)
    now = timezone.now()
    TaskExecution.objects.bulk_create(
        [
            TaskExecution(
                workflow_execution=execution,
                tenant=tenant,
                task_name=f"t{i}",
                function="demo.steps:f",
                status=TaskStatus.READY,
                ready_at=now,
                position=i + 1,
            )
            for i in range(count - 1)
        ]
    )
    return list(
        TaskExecution.objects.filter(workflow_execution=execution).values_list("id", flat=True)
    )


@pytest.mark.django_db
def test_a_claim_moves_the_task_to_running_and_bumps_the_fencing_token(tenant):
    execution, task = one_task_execution(tenant, timeout_s=12)
    claim = claim_task(task.pk, "server-1")
    assert (claim.task_name, claim.assignment, claim.attempt, claim.timeout_s) == ("a", 1, 1, 12.0)
    task.refresh_from_db()
    assert (task.status, task.claimed_by, task.assignment, task.attempt) == (
        "Running",
        "server-1",
        1,
        1,
    )
    budget = (task.result_deadline - task.claimed_at).total_seconds()
    assert budget == pytest.approx(12 + RESULT_GRACE_S, abs=0.5)
    assert WorkflowExecution.objects.get(pk=execution.pk).status == WorkflowStatus.RUNNING
    assert claim_task(task.pk, "server-2") is None  # already taken


@pytest.mark.django_db
def test_a_task_is_not_claimed_before_its_ready_at(tenant):
    _, task = one_task_execution(tenant)
    TaskExecution.objects.filter(pk=task.pk).update(ready_at=timezone.now() + timedelta(hours=1))
    assert claim_task(task.pk, "s") is None
    assert claim_ready_tasks("s", 10) == []
    assert due_ready_task_events(10) == []


@pytest.mark.django_db
def test_deadline_false_leaves_the_result_clock_unset(tenant):
    _, task = one_task_execution(tenant)
    claim_task(task.pk, "s", deadline=False)
    task.refresh_from_db()
    assert task.result_deadline is None


@pytest.mark.django_db
def test_release_puts_the_task_back_without_using_an_attempt(tenant):
    _, task = one_task_execution(tenant)
    claim = claim_task(task.pk, "s")
    assert release_claim(task.pk, claim.assignment, "no agent")
    task.refresh_from_db()
    assert (task.status, task.attempt, task.assignment, task.wait_reason) == (
        "Ready",
        0,
        1,
        "no agent",
    )
    assert not release_claim(task.pk, claim.assignment, "twice")  # not Running any more
    again = claim_task(task.pk, "s")
    assert (again.assignment, again.attempt) == (2, 1)  # the old assignment stays fenced off
    assert not release_claim(task.pk, claim.assignment, "stale assignment")


@pytest.mark.django_db
def test_claim_ready_tasks_takes_the_highest_priority_first(tenant):
    ids = many_ready_tasks(tenant, 5)
    TaskExecution.objects.filter(pk=ids[3]).update(priority=10)
    claims = claim_ready_tasks("s", 1)
    assert [c.task_execution_id for c in claims] == [ids[3]]
    assert len(claim_ready_tasks("s", 10)) == 4
    assert claim_ready_tasks("s", 10) == []


@pytest.mark.django_db(transaction=True)
def test_two_claimers_racing_with_claim_ready_tasks_claim_each_task_exactly_once(tenant):
    ids = many_ready_tasks(tenant, 200)

    def drain() -> list[uuid.UUID]:
        mine = []
        while batch := claim_ready_tasks(threading.current_thread().name, 7):
            mine.extend(c.task_execution_id for c in batch)
        return mine

    first, second = race(2, lambda _index: drain())
    assert len(first) + len(second) == 200
    assert set(first) | set(second) == set(ids)
    assert not set(first) & set(second)
    assert first and second  # both really took part
    rows = TaskExecution.objects.filter(pk__in=ids)
    assert set(rows.values_list("status", "assignment", "attempt")) == {("Running", 1, 1)}


@pytest.mark.django_db(transaction=True)
def test_two_claimers_racing_with_claim_task_on_the_same_ids_claim_each_exactly_once(tenant):
    ids = many_ready_tasks(tenant, 200)

    order = iter([ids, ids[::-1]])  # opposite directions: they must meet, however fast claims are

    def claim_all() -> list[uuid.UUID]:
        name = threading.current_thread().name
        return [i for i in next(order) if claim_task(i, name) is not None]

    first, second = race(2, lambda _index: claim_all())
    assert sorted(first + second) == sorted(ids)
    assert not set(first) & set(second)
    claimers = TaskExecution.objects.filter(pk__in=ids).values_list("claimed_by", flat=True)
    assert len(set(claimers)) == 2
    assert set(TaskExecution.objects.filter(pk__in=ids).values_list("assignment", flat=True)) == {1}


@pytest.mark.django_db
@pytest.mark.parametrize("statement", ["_CLAIM_ONE", "_CLAIM_MANY", "_CLAIM_THESE"])
def test_the_due_rows_are_picked_once_whatever_the_plan(tenant, statement):
    """Inside ``t.id IN (…)`` the planner may re-run a LIMIT … SKIP LOCKED subquery for each
    candidate row, each run skipping the rows the statement already updated and picking
    others: a CI run once got three claims from ``claim_ready_tasks("s", 1)``.  The due rows
    are a MATERIALIZED CTE, which PostgreSQL evaluates exactly once."""
    from django.db import connection

    from fleet.engine import claims as claims_module

    ids = many_ready_tasks(tenant, 3)
    params = {"task_execution_id": ids[0], "task_execution_ids": ids, "limit": 1, "claimer": "s",
              "deadline": True, "relax": False, "grace": 30.0}  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + getattr(claims_module, statement), params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "CTE due" in plan and "CTE Scan on due" in plan, plan


@pytest.mark.django_db
def test_claim_work_reads_contexts_and_packages_in_the_claims_one_statement(tenant):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from fleet.engine.claims import claim_work
    from fleet.engine.context import build_task_context, encode_context
    from fleet.engine.results import TaskReport, result_handler

    chain = [
        {"id": "a", "function": "demo.steps:f"},
        {"id": "b", "function": "demo.steps:f", "dependencies": ["a"]},
        {"id": "d", "function": "demo.steps:f", "dependencies": ["b", "a"]},
    ]
    package = make_package(tenant, chain, SOURCE, workflow="chain")
    execution, tasks = start(tenant, "chain", {"in": "✓", "k": 0})
    for name, output in (("a", {"k": 1, "a": 1}), ("b", {"k": 2, "b": 1.5})):
        claim = claim_task(tasks[name].pk, "server-1")
        result_handler.apply(TaskReport(claim.task_execution_id, 1, "success", output=output))
    expected = encode_context(build_task_context(tasks["d"].pk))
    other = start(tenant, "chain", {"x": 1})[1]["a"]  # a root task of a second execution

    with CaptureQueriesContext(connection) as queries:
        claimed = claim_work([tasks["d"].pk, other.pk, tasks["a"].pk], "server-1")
    assert len(queries) == 1  # claim, contexts and packages: one round trip
    by_task = {work.claim.task_execution_id: work for work in claimed}
    assert set(by_task) == {tasks["d"].pk, other.pk}  # a is done: not claimed
    d = by_task[tasks["d"].pk]
    assert (d.claim.task_name, d.claim.assignment, d.claim.workflow_execution_id) == (
        "d", 1, execution.pk,
    )  # fmt: skip
    assert encode_context(d.context) == expected
    assert d.context == {"in": "✓", "k": 2, "a": 1, "b": 1.5}
    assert by_task[other.pk].context == {"x": 1}
    for work in claimed:
        assert (work.package.pk, work.package.digest, work.package.kind) == (
            package.pk, package.digest, package.kind,
        )  # fmt: skip
        assert (work.package.tenant_id, work.package.host_triple) == (
            package.tenant_id, package.host_triple,
        )  # fmt: skip
        assert (work.tenant_name, work.workflow_name) == (tenant.name, "chain")
    # The fields the statement does not read are deferred (loaded if read), not defaults.
    assert "manifest" in claimed[0].package.get_deferred_fields()
    assert claimed[0].package.manifest == package.manifest
    assert TaskExecution.objects.get(pk=tasks["d"].pk).status == TaskStatus.RUNNING
