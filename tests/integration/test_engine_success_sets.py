"""A batch's current successes applied as a set (fleet/engine/success_sets.py): one statement
for N successes, each fenced, recorded and settled exactly as the per-row path would, the
rest of the batch (stale, duplicate, failures) left to the per-row path."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from agents.models import Agent
from fleet.engine import ready_queue, success_sets
from fleet.engine.claims import claim_tasks
from fleet.engine.events import ExecutionStatus
from fleet.engine.outcome_batches import apply_reports
from fleet.engine.results import TaskReport
from fleet.executors.fleet.result_intake import apply_results
from fleet.models import DeliveryOutbox, Outcome, TaskExecution, TaskOutcome, WorkflowExecution
from tests.support.agents import make_agent
from tests.support.factories import make_package, start
from tests.support.outcomes import delivered_tasks, result_in

SOURCE = "def noop(context):\n    return None\n"


def publish(tenant, workflow: str, tasks: list[dict]) -> None:
    make_package(tenant, tasks, SOURCE, name=workflow.replace("_", "-"), workflow=workflow)


def wide(tenant, workflow: str = "wide", width: int = 4) -> None:
    publish(
        tenant, workflow, [{"id": f"t{i}", "function": "demo.steps:noop"} for i in range(width)]
    )


def chain(tenant) -> None:
    """``a`` → ``b`` (all_success) and ``a`` → ``on_failure`` (one_failed: Skipped when ``a``
    succeeds, and ``after_that`` with it)."""
    publish(
        tenant,
        "chain",
        [
            {"id": "a", "function": "demo.steps:noop"},
            {"id": "b", "function": "demo.steps:noop", "dependencies": ["a"]},
            {
                "id": "on_failure",
                "function": "demo.steps:noop",
                "dependencies": ["a"],
                "trigger_rule": "one_failed",
            },
            {"id": "after_that", "function": "demo.steps:noop", "dependencies": ["on_failure"]},
        ],
    )


def claimed(execution) -> dict:
    """Claim the Ready tasks of ``execution``: task name → claim."""
    ids = list(
        TaskExecution.objects.filter(workflow_execution=execution, status="Ready").values_list(
            "pk", flat=True
        )
    )
    return {claim.task_name: claim for claim in claim_tasks(ids, "s")}


def success(claim, **extra) -> tuple:
    body = {"output": {claim.task_name: claim.assignment}, **extra}
    report = TaskReport(claim.task_execution_id, claim.assignment, Outcome.SUCCESS, **body)
    return claim.workflow_execution_id, report


@pytest.fixture
def offered(monkeypatch) -> list:
    events: list = []
    monkeypatch.setattr(ready_queue, "submit", lambda ready: events.extend(ready))
    return events


@pytest.mark.django_db
def test_a_mixed_batch_applies_each_outcome_as_alone(tenant, offered):
    wide(tenant)
    chain(tenant)
    finishing, _ = start(tenant, "wide", {"input": 1})
    other, _ = start(tenant, "wide", {})
    chained, tasks = start(tenant, "chain", {})
    f, o, c = claimed(finishing), claimed(other), claimed(chained)
    # ``other``'s t0 was reclaimed and handed out again: its first assignment is stale.
    TaskExecution.objects.filter(pk=o["t0"].task_execution_id).update(assignment=2)
    reports = [
        *(success(f[name]) for name in ("t0", "t1", "t2", "t3")),
        success(f["t1"], output={"again": 1}),  # a duplicate
        success(o["t0"]),  # stale
        success(c["a"]),  # its dependents are decided
        (
            o["t1"].workflow_execution_id,
            TaskReport(o["t1"].task_execution_id, o["t1"].assignment, Outcome.FAILURE),
        ),
    ]
    applied = apply_reports(reports)

    assert [a.applied for a in applied] == [True] * 4 + [False, False, True, True]
    assert applied[4].reason == "task is Completed, not Running"
    assert applied[5].reason == "assignment 1 is not current (2)"
    assert [a.status for a in applied[:4]] == [ExecutionStatus.COMPLETED] * 4
    assert applied[7].status == ExecutionStatus.FAILED
    # Finished by the batch: the input, then every output in manifest order.
    finished = WorkflowExecution.objects.get(pk=finishing.pk)
    assert finished.status == "Completed" and finished.open_tasks == 0
    assert finished.final_context == {"input": 1, "t0": 1, "t1": 1, "t2": 1, "t3": 1}
    assert WorkflowExecution.objects.get(pk=other.pk).open_tasks == 3  # t1 failed
    # ``a``'s dependents decided once: b Ready (offered), the one_failed branch Skipped.
    states = dict(
        TaskExecution.objects.filter(workflow_execution=chained).values_list("task_name", "status")
    )
    assert states == {
        "a": "Completed",
        "b": "Ready",
        "on_failure": "Skipped",
        "after_that": "Skipped",
    }
    assert [e.task_execution_id for e in applied[6].ready] == [tasks["b"].pk]
    assert WorkflowExecution.objects.get(pk=chained.pk).open_tasks == 1  # b
    # One applied outcome per applied report; the duplicate and the stale one kept unapplied.
    assert TaskOutcome.objects.filter(applied=True).count() == 6
    assert sorted(
        TaskOutcome.objects.filter(applied=False).values_list("ignored_reason", flat=True)
    ) == ["assignment 1 is not current (2)", "task is Completed, not Running"]
    assert TaskExecution.objects.get(pk=f["t1"].task_execution_id).output_context == {"t1": 1}
    assert TaskExecution.objects.get(pk=o["t0"].task_execution_id).status == "Running"


@pytest.mark.django_db
def test_successes_of_a_batch_cost_a_fixed_number_of_statements(tenant, offered):
    """One statement completes, records and settles them all, one finishes the execution:
    the count does not grow with the batch (the per-row path took one statement each)."""
    wide(tenant, width=12)
    execution, _ = start(tenant, "wide", {})
    reports = [success(claim) for claim in claimed(execution).values()]
    with CaptureQueriesContext(connection) as queries:
        applied = apply_reports(reports)
    assert [a.applied for a in applied] == [True] * 12
    assert WorkflowExecution.objects.get(pk=execution.pk).status == "Completed"
    statements = [q["sql"] for q in queries.captured_queries]
    assert sum("UPDATE fleet_taskexecution" in sql for sql in statements) == 1
    assert len(statements) <= 4, statements  # BEGIN/COMMIT aside: the set, the finish


@pytest.mark.django_db
def test_the_settle_hook_acks_each_packet_and_frees_each_slot_once(tenant, offered):
    """The fleet's settle hook inside the set statements: every applied success's packet
    acked and its slot given back (an agent holding several counted several times), in
    a batch of leaves and in one where dependents are decided first."""
    wide(tenant)
    chain(tenant)
    agents = [make_agent(tenant, f"a{i}", max_concurrency=8) for i in range(2)]
    leaves, _ = start(tenant, "wide", {})
    placed = delivered_tasks(leaves)
    items = [(tenant.pk, row.agent_id, result_in(task, row)) for task, row in placed]
    assert apply_results(items) == [(200, {"applied": True, "reason": ""})] * 4
    assert [Agent.objects.get(pk=a.pk).in_flight for a in agents] == [0, 0]
    assert WorkflowExecution.objects.get(pk=leaves.pk).status == "Completed"

    mixed, _ = start(tenant, "wide", {})
    chained, _ = start(tenant, "chain", {})
    placed = delivered_tasks(mixed) + delivered_tasks(chained)
    stale_task, stale_row = placed[0]
    TaskExecution.objects.filter(pk=stale_task.pk).update(assignment=stale_row.assignment + 1)
    items = [(tenant.pk, row.agent_id, result_in(task, row)) for task, row in placed]
    answers = apply_results(items)
    assert answers[0] == (
        200,
        {"applied": False, "reason": f"assignment 1 is not current ({stale_row.assignment + 1})"},
    )
    assert answers[1:] == [(200, {"applied": True, "reason": ""})] * 4
    states = dict(DeliveryOutbox.objects.values_list("task_execution_id", "state"))
    assert states.pop(stale_task.pk) == "delivered"  # its outcome was not applied
    assert set(states.values()) == {"acked"}
    assert sum(Agent.objects.get(pk=a.pk).in_flight for a in agents) == 1  # the stale one's
    b = TaskExecution.objects.get(workflow_execution=chained, task_name="b")
    assert b.status == "Ready"
    assert [e.task_execution_id for e in offered] == [b.pk]  # offered once, after the commit


@pytest.mark.django_db
@pytest.mark.parametrize("workflow", ["wide", "chain"], ids=["leaves", "dependents"])
def test_a_set_answers_what_its_tasks_held_on_one_row(tenant, offered, monkeypatch, workflow):
    """Both set statements (leaves only; dependents decided first) carry the agents the
    settled tasks held on one row, not on each: a batch of N loaded N² ids."""
    wide(tenant)
    chain(tenant)
    agent = make_agent(tenant, "a", max_concurrency=8)
    answers: list[list] = []
    real = success_sets._holders

    def spy(rows, column):
        answers.append([row[column] for row in rows])
        return real(rows, column)

    monkeypatch.setattr(success_sets, "_holders", spy)
    placed = [
        delivered
        for _ in range(2)  # a chain has one root: two of them make a set
        for delivered in delivered_tasks(start(tenant, workflow, {})[0])
    ]
    items = [(tenant.pk, row.agent_id, result_in(task, row)) for task, row in placed]
    assert [answer for answer, _body in apply_results(items)] == [200] * len(placed)
    (column,) = answers
    carried = [value for value in column if value is not None]
    assert carried == [[agent.pk] * len(placed)]
    assert Agent.objects.get(pk=agent.pk).in_flight == 0


@pytest.mark.django_db
def test_a_batch_clears_breaker_failures_and_skips_the_breaker_for_healthy_agents(tenant, offered):
    """The intake check tells which agents have breaker state a success must clear: their
    failures are forgotten in the batch; for healthy agents the breaker statement is not
    even sent."""
    wide(tenant)
    flaky, healthy = (make_agent(tenant, name, max_concurrency=8) for name in ("flaky", "ok"))
    first, _ = start(tenant, "wide", {})
    placed = delivered_tasks(first)
    Agent.objects.filter(pk=flaky.pk).update(breaker_failures=3)
    items = [(tenant.pk, row.agent_id, result_in(task, row)) for task, row in placed]
    assert {row.agent_id for _task, row in placed} == {flaky.pk, healthy.pk}
    assert apply_results(items) == [(200, {"applied": True, "reason": ""})] * 4
    assert Agent.objects.get(pk=flaky.pk).breaker_failures == 0

    second, _ = start(tenant, "wide", {})
    items = [
        (tenant.pk, row.agent_id, result_in(task, row)) for task, row in delivered_tasks(second)
    ]
    with CaptureQueriesContext(connection) as queries:
        assert apply_results(items) == [(200, {"applied": True, "reason": ""})] * 4
    assert not [q for q in queries.captured_queries if "breaker_failures = 0" in q["sql"]]
    assert [Agent.objects.get(pk=a.pk).in_flight for a in (flaky, healthy)] == [0, 0]
