"""Many agent results in one transaction (agents/result_intake.apply_results): each answered
exactly as alone, applied once, the agents' slots released once at the end."""

from __future__ import annotations

import pytest
from django.db import OperationalError

from agents.models import Agent
from fleet.engine import ready_queue
from fleet.engine import results as engine_results
from fleet.executors.fleet.result_intake import apply_result, apply_results
from fleet.models import DeliveryOutbox, TaskExecution, TaskOutcome
from tests.support.agents import make_agent
from tests.support.factories import make_package, start
from tests.support.outcomes import delivered_tasks, result_in

SOURCE = "def noop(context):\n    return None\n"


def delivered(tenant, workflow: str) -> dict:
    """Start ``workflow``, place its Ready tasks, mark their packets delivered: task id →
    (task, row)."""
    execution, _tasks = start(tenant, workflow, {})
    return {task.task_name: (task, row) for task, row in delivered_tasks(execution)}


@pytest.fixture
def wide(tenant):
    tasks = [{"id": f"t{i}", "function": "demo.steps:noop"} for i in range(4)]
    make_package(tenant, tasks, SOURCE, name="wide", workflow="wide")


@pytest.mark.django_db
def test_a_batch_applies_every_result_and_frees_each_slot_once(tenant, wide):
    agents = [make_agent(tenant, f"a{i}", max_concurrency=4) for i in range(2)]
    placed = delivered(tenant, "wide")
    assert sum(Agent.objects.get(pk=a.pk).in_flight for a in agents) == 4
    items = [(tenant.pk, row.agent_id, result_in(task, row)) for task, row in placed.values()]
    answers = apply_results(items)
    assert answers == [(200, {"applied": True, "reason": ""})] * 4
    assert set(TaskExecution.objects.values_list("status", flat=True)) == {"Completed"}
    assert set(DeliveryOutbox.objects.values_list("state", flat=True)) == {"acked"}
    assert [Agent.objects.get(pk=a.pk).in_flight for a in agents] == [0, 0]
    assert TaskExecution.objects.get(task_name="t2").output_context == {"t2": 1}


@pytest.mark.django_db
def test_each_result_of_a_batch_gets_its_own_answer(tenant, wide, other_tenant):
    agent = make_agent(tenant, "a", max_concurrency=8)
    stranger = make_agent(other_tenant, "stranger")
    placed = delivered(tenant, "wide")
    (t0, r0), (t1, r1), (t2, r2), (t3, r3) = placed.values()
    items = [
        (tenant.pk, agent.id, result_in(t0, r0)),
        (tenant.pk, agent.id, result_in(t0, r0, output={"again": 1})),  # a duplicate
        (other_tenant.pk, stranger.id, result_in(t1, r1)),  # another tenant's packet
        (tenant.pk, agent.id, result_in(t2, r2, outbox_id=r3.id)),
        (tenant.pk, agent.id, result_in(t3, r3, outcome="failure", output=None)),
    ]
    answers = apply_results(items)
    assert answers[0] == (200, {"applied": True, "reason": ""})
    assert answers[1] == (200, {"applied": False, "reason": "task is Completed, not Running"})
    assert answers[2][0] == 404 and "never addressed to this agent" in answers[2][1]["detail"]
    assert answers[3][0] == 404  # the packet named is not this task's
    assert answers[4] == (200, {"applied": True, "reason": ""})
    assert TaskExecution.objects.get(pk=t0.pk).output_context == {"t0": 1}
    assert TaskExecution.objects.get(pk=t1.pk).status == "Running"
    assert TaskExecution.objects.get(pk=t3.pk).status == "Failed"
    # Two packets acked (t0, t3): two slots freed, the two still open keep theirs.
    assert Agent.objects.get(pk=agent.pk).in_flight == 2
    assert TaskOutcome.objects.filter(task_execution_id=t0.pk).count() == 2


@pytest.mark.django_db
def test_two_dependencies_finishing_in_one_batch_make_the_join_ready_once(tenant, monkeypatch):
    make_package(
        tenant,
        [
            {"id": "left", "function": "demo.steps:noop"},
            {"id": "right", "function": "demo.steps:noop"},
            {"id": "join", "function": "demo.steps:noop", "dependencies": ["left", "right"]},
        ],
        SOURCE,
        name="diamond",
        workflow="diamond",
    )
    agent = make_agent(tenant, "a", max_concurrency=4)
    offered = []
    monkeypatch.setattr(ready_queue, "submit", lambda events: offered.extend(events))
    placed = delivered(tenant, "diamond")
    items = [(tenant.pk, agent.id, result_in(task, row)) for task, row in placed.values()]
    assert [a[0] for a in apply_results(items)] == [200, 200]
    join = TaskExecution.objects.get(task_name="join")
    assert join.status == "Ready"
    assert [e.task_execution_id for e in offered] == [join.pk]


@pytest.mark.django_db
def test_a_batch_that_fails_is_applied_again_result_by_result(tenant, wide, monkeypatch):
    agent = make_agent(tenant, "a", max_concurrency=8)
    placed = delivered(tenant, "wide")
    items = [(tenant.pk, agent.id, result_in(task, row)) for task, row in placed.values()]
    real_release = engine_results.release_slots
    calls = []

    def deadlock_once(agent_ids):
        calls.append(list(agent_ids))
        if len(calls) == 1:
            raise OperationalError("deadlock detected")
        real_release(agent_ids)

    monkeypatch.setattr("fleet.executors.fleet.result_intake.release_slots", deadlock_once)
    answers = apply_results(items)
    assert answers == [(200, {"applied": True, "reason": ""})] * 4
    # Nothing of the failed batch remained: one applied outcome per task, slots freed once.
    assert TaskOutcome.objects.filter(applied=True).count() == 4
    assert TaskOutcome.objects.count() == 4
    assert Agent.objects.get(pk=agent.pk).in_flight == 0


@pytest.mark.django_db
def test_a_single_result_frees_its_slot_in_its_own_transaction(tenant, wide):
    agent = make_agent(tenant, "a", max_concurrency=8)
    task, row = next(iter(delivered(tenant, "wide").values()))
    assert apply_result(tenant.pk, agent.id, result_in(task, row)) == (
        200,
        {"applied": True, "reason": ""},
    )
    assert Agent.objects.get(pk=agent.pk).in_flight == 3


@pytest.mark.django_db
def test_a_result_failing_in_its_handler_sends_the_whole_batch_result_by_result(tenant, wide):
    """No savepoint per result in a batch: a handler that hits a database error (here a
    concurrent duplicate's unique violation) makes the batch roll back and every result go
    through a transaction of its own, where the others apply and that one is answered."""
    agent = make_agent(tenant, "a", max_concurrency=8)
    placed = list(delivered(tenant, "wide").values())
    task, row = placed[0]
    # As if a concurrent duplicate of this outcome had just been committed.
    TaskOutcome.objects.create(
        task_execution_id=task.pk,
        assignment=row.assignment,
        attempt=1,
        outcome="success",
        applied=True,
    )
    items = [(tenant.pk, agent.id, result_in(t, r)) for t, r in placed]
    answers = apply_results(items)
    assert answers[0] == (200, {"applied": False, "reason": "duplicate outcome"})
    assert answers[1:] == [(200, {"applied": True, "reason": ""})] * 3
    assert TaskOutcome.objects.filter(applied=True).count() == 4
    assert TaskExecution.objects.filter(status="Completed").count() == 3
    assert Agent.objects.get(pk=agent.pk).in_flight == 1  # the duplicate's packet stays open


@pytest.mark.django_db(transaction=True)
def test_a_batch_of_successes_costs_three_round_trips(tenant, wide):
    """BEGIN goes out with the intake check, COMMIT with the slot release: the check, the
    outcomes and the release are the batch's only round trips."""
    from tests.support.round_trips import RoundTrips  # local: only this test traces

    agent = make_agent(tenant, "a", max_concurrency=8)
    placed = list(delivered(tenant, "wide").values())[:3]  # the execution stays open
    items = [(tenant.pk, agent.id, result_in(task, row)) for task, row in placed]
    with RoundTrips() as traced:
        answers = apply_results(items)
    assert answers == [(200, {"applied": True, "reason": ""})] * 3
    # The batch's transaction, then (no dispatcher waits here) the NOTIFY that wakes the
    # ones of other processes, after the commit.
    *transaction, notify = traced.trips()
    assert len(transaction) == 3, transaction
    assert transaction[0].count("Execute") == 2  # BEGIN + the intake check
    assert transaction[-1].count("Execute") == 2 and "Sync" in transaction[-1]  # release + COMMIT
    assert notify == ["Query"]
    sent = [fields[3] for fields in traced.lines if len(fields) > 3 and fields[0] == "F"]
    assert [text for text in sent if '"COMMIT"' in text or "pg_notify" in text][-1].count(
        "pg_notify"
    ) == 1
    assert TaskExecution.objects.filter(status="Completed").count() == 3
    assert Agent.objects.get(pk=agent.pk).in_flight == 1


@pytest.mark.django_db(transaction=True)
def test_an_error_in_the_statement_sent_with_the_commit_applies_the_batch_result_by_result(
    tenant, wide, monkeypatch
):
    """The slot release travels with the COMMIT: when it fails there, nothing of the batch is
    committed and every result is applied again in a transaction of its own."""
    from django.db import connection  # local: only this test sends a statement of its own

    agent = make_agent(tenant, "a", max_concurrency=8)
    placed = delivered(tenant, "wide")
    items = [(tenant.pk, agent.id, result_in(task, row)) for task, row in placed.values()]
    real_release = engine_results.release_slots
    calls = []

    def failing_in_the_pipeline_once(agent_ids):
        calls.append(list(agent_ids))
        if len(calls) == 1:  # a division by zero the server reports only at the COMMIT's sync
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1 / (SELECT count(*) - count(*) FROM agents_agent)")
            return
        real_release(agent_ids)

    monkeypatch.setattr(
        "fleet.executors.fleet.result_intake.release_slots", failing_in_the_pipeline_once
    )
    answers = apply_results(items)
    assert answers == [(200, {"applied": True, "reason": ""})] * 4
    assert len(calls) == 5  # the failed batch, then each result alone
    assert TaskOutcome.objects.filter(applied=True).count() == 4
    assert TaskOutcome.objects.count() == 4
    assert Agent.objects.get(pk=agent.pk).in_flight == 0
    assert set(DeliveryOutbox.objects.values_list("state", flat=True)) == {"acked"}
