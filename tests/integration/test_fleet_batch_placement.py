"""Placing many Ready tasks in one transaction (fleet/executors/fleet/delivery/batch_placement.py): the same
outcome per task as place_task, one claim statement, plain tasks reserved together."""

from __future__ import annotations

import threading
from collections import Counter
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from agents.models import Agent
from fleet.engine.context import build_task_context, encode_context
from fleet.executors.fleet.delivery.batch_placement import place_tasks
from fleet.executors.fleet.delivery.placement import (
    Delivered,
    NoAgent,
    NotClaimed,
    Placed,
    Unroutable,
)
from fleet.models import DeliveryOutbox, TaskExecution
from tests.support.agents import make_agent
from tests.support.factories import make_package, start

SOURCE = "def noop(context):\n    return None\n"


def wide_package(tenant, width: int, workflow: str = "wide", **task_extra):
    tasks = [{"id": f"t{i}", "function": "demo.steps:noop", **task_extra} for i in range(width)]
    return make_package(tenant, tasks, SOURCE, name=workflow, workflow=workflow)


def ready_tasks(tenant, workflow: str = "wide", executions: int = 1, context=None) -> list:
    ids = []
    for _ in range(executions):
        _execution, tasks = start(tenant, workflow, context or {})
        ids += [t.pk for t in tasks.values() if t.status == "Ready"]
    return ids


@pytest.mark.django_db
def test_a_batch_is_spread_over_the_agents_one_slot_per_agent_per_round(tenant):
    wide_package(tenant, 6)
    agents = [make_agent(tenant, f"a{i}", max_concurrency=4) for i in range(3)]
    ids = ready_tasks(tenant)
    placed = place_tasks(ids, "server-1")
    assert all(isinstance(p, Placed) for p in placed.values())
    per_agent = Counter(p.agent_id for p in placed.values())
    assert sorted(per_agent.values()) == [2, 2, 2]
    for agent in agents:
        agent.refresh_from_db()
        assert agent.in_flight == 2
    rows = DeliveryOutbox.objects.filter(task_execution_id__in=ids)
    assert rows.count() == 6
    for row in rows:
        task = TaskExecution.objects.get(pk=row.task_execution_id)
        assert (task.status, task.attempt, task.agent_id) == ("Running", 1, row.agent_id)
        assert row.assignment == task.assignment == placed[task.pk].assignment
        # the shared context builder's exact bytes, and the agent's triple stamped on it
        assert row.payload["context_json"] == encode_context(build_task_context(task.pk))
        assert row.payload["target_triple"] == agents[0].target_triple


@pytest.mark.django_db
def test_packets_for_agents_connected_here_are_delivered_with_their_clock_started(tenant):
    wide_package(tenant, 2)
    local = make_agent(tenant, "local", max_concurrency=1)
    remote = make_agent(tenant, "remote", max_concurrency=1)
    Agent.objects.filter(pk=remote.pk).update(connected_to="another-server")
    ids = ready_tasks(tenant)
    placed = place_tasks(ids, "server-1")
    by_agent = {p.agent_id: (task_execution_id, p) for task_execution_id, p in placed.items()}
    task_execution_id, here = by_agent[local.id]
    assert isinstance(here, Delivered)
    row = DeliveryOutbox.objects.get(task_execution_id=task_execution_id)
    assert (row.state, row.attempts, row.id) == ("delivered", 1, here.outbox_id)
    assert row.delivered_at is not None and row.received_at is None
    assert here.packet == {**row.payload, "outbox_id": row.id}
    assert TaskExecution.objects.get(pk=task_execution_id).result_deadline is not None
    task_execution_id, there = by_agent[remote.id]
    assert type(there) is Placed  # the relay of the server holding its socket pushes it
    row = DeliveryOutbox.objects.get(task_execution_id=task_execution_id)
    assert (row.state, row.attempts, row.delivered_at) == ("pending", 0, None)
    assert TaskExecution.objects.get(pk=task_execution_id).result_deadline is None


@pytest.mark.django_db
def test_tasks_beyond_the_free_slots_wait_with_the_reason_and_keep_their_attempt(tenant):
    wide_package(tenant, 5)
    make_agent(tenant, "a", max_concurrency=2)
    ids = ready_tasks(tenant)
    placed = place_tasks(ids, "server-1")
    waiting = [
        task_execution_id for task_execution_id, p in placed.items() if isinstance(p, NoAgent)
    ]
    assert len(waiting) == 3
    assert {placed[t].reason for t in waiting} == {"the 1 live agent is at capacity"}
    for task in TaskExecution.objects.filter(pk__in=waiting):
        assert (task.status, task.attempt, task.agent_id) == ("Ready", 0, None)
        assert task.wait_reason == "the 1 live agent is at capacity"
    assert DeliveryOutbox.objects.count() == 2
    assert Agent.objects.get(name="a").in_flight == 2


@pytest.mark.django_db
def test_healthy_agents_fill_before_a_degraded_one_gets_work(tenant):
    wide_package(tenant, 5)
    healthy = make_agent(tenant, "healthy", max_concurrency=3)
    slow = make_agent(tenant, "slow", max_concurrency=3)
    # A beat older than 2 intervals (but within the liveness window): degraded.
    Agent.objects.filter(pk=slow.pk).update(last_heartbeat=timezone.now() - timedelta(seconds=35))
    placed = place_tasks(ready_tasks(tenant), "server-1")
    per_agent = Counter(p.agent_id for p in placed.values() if isinstance(p, Placed))
    assert per_agent == {healthy.id: 3, slow.id: 2}


@pytest.mark.django_db
def test_tasks_with_selectors_take_the_single_task_path_in_the_same_batch(tenant):
    make_package(
        tenant,
        [
            {"id": "plain", "function": "demo.steps:noop"},
            {"id": "pinned", "function": "demo.steps:noop", "agent": "b"},
            {"id": "nowhere", "function": "demo.steps:noop", "agent": "nobody"},
        ],
        SOURCE,
        name="mixed",
        workflow="mixed",
    )
    make_agent(tenant, "a", max_concurrency=4)
    b = make_agent(tenant, "b", max_concurrency=4)
    _execution, tasks = start(tenant, "mixed", {})
    placed = place_tasks([t.pk for t in tasks.values()], "server-1")
    assert placed[tasks["pinned"].pk].agent_id == b.id
    assert isinstance(placed[tasks["plain"].pk], Placed)
    nowhere = placed[tasks["nowhere"].pk]
    assert isinstance(nowhere, Unroutable) and "NoMatchingAgent" in nowhere.reason
    assert TaskExecution.objects.get(pk=tasks["nowhere"].pk).status == "Failed"


@pytest.mark.django_db
def test_tasks_not_ready_are_not_claimed(tenant):
    wide_package(tenant, 2)
    make_agent(tenant, "a", max_concurrency=4)
    ids = ready_tasks(tenant)
    TaskExecution.objects.filter(pk=ids[0]).update(status="Skipped")
    placed = place_tasks(ids, "server-1")
    assert isinstance(placed[ids[0]], NotClaimed) and not isinstance(placed[ids[0]], Unroutable)
    assert isinstance(placed[ids[1]], Placed)
    assert place_tasks([ids[1]], "server-1") == {ids[1]: NotClaimed()}  # already Running


@pytest.mark.django_db(transaction=True)
def test_concurrent_batches_never_overfill_an_agent(tenant):
    wide_package(tenant, 10)
    agents = [make_agent(tenant, f"a{i}", max_concurrency=5) for i in range(2)]
    ids = ready_tasks(tenant, executions=4)  # 40 tasks for 10 slots
    chunks = [ids[i::4] for i in range(4)]
    results: dict = {}
    barrier = threading.Barrier(len(chunks))

    def worker(chunk) -> None:
        try:
            barrier.wait()
            results.update(place_tasks(chunk, "server-1"))
        finally:
            connection.close()

    threads = [threading.Thread(target=worker, args=(chunk,)) for chunk in chunks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    placed = [p for p in results.values() if isinstance(p, Placed)]
    assert len(results) == 40
    assert len(placed) == 10  # every slot used, none twice
    for agent in agents:
        agent.refresh_from_db()
        assert agent.in_flight == 5
        assert DeliveryOutbox.objects.filter(agent=agent).count() == 5
    assert TaskExecution.objects.filter(status="Running").count() == 10
    assert TaskExecution.objects.filter(status="Ready", attempt=0).count() == 30


@pytest.mark.django_db
def test_a_batch_that_fails_is_placed_again_task_by_task(tenant, monkeypatch):
    from django.db import OperationalError

    from fleet.executors.fleet.delivery import batch_placement

    wide_package(tenant, 3)
    make_agent(tenant, "a", max_concurrency=4)
    ids = ready_tasks(tenant)

    def deadlock(group, *_prelocked):
        raise OperationalError("deadlock detected")

    monkeypatch.setattr(batch_placement, "_place_plain", deadlock)
    placed = place_tasks(ids, "server-1")
    assert all(isinstance(p, Placed) for p in placed.values())
    # Nothing of the failed batch remained: one claim, one row per task.
    assert DeliveryOutbox.objects.filter(task_execution_id__in=ids).count() == 3
    assert set(TaskExecution.objects.values_list("attempt", flat=True)) == {1}


@pytest.mark.django_db
def test_batch_contexts_are_the_single_builders_exact_contexts(tenant):
    from fleet.engine.context import build_task_contexts
    from fleet.engine.results import TaskReport, result_handler

    make_package(
        tenant,
        [
            {"id": "a", "function": "demo.steps:noop"},
            {"id": "b", "function": "demo.steps:noop", "dependencies": ["a"]},
            {"id": "c", "function": "demo.steps:noop", "dependencies": ["a"]},
            {"id": "d", "function": "demo.steps:noop", "dependencies": ["c", "b"]},
        ],
        SOURCE,
        name="diamond",
        workflow="diamond",
    )
    _execution, tasks = start(tenant, "diamond", {"in": "✓", "k": 0})
    for name, output in (("a", {"k": 1, "a": 1}), ("b", {"k": 2}), ("c", {"k": 3, "c": 1.5})):
        task = TaskExecution.objects.get(pk=tasks[name].pk)
        TaskExecution.objects.filter(pk=task.pk).update(status="Running", assignment=1)
        result_handler.apply(TaskReport(task.pk, 1, "success", output=output))
    ids = [t.pk for t in tasks.values()]
    batch = build_task_contexts(ids + [tasks["a"].workflow_execution_id])  # + an unknown id
    assert set(batch) == set(ids)
    for task_execution_id in ids:
        assert encode_context(batch[task_execution_id]) == encode_context(
            build_task_context(task_execution_id)
        )
    assert batch[tasks["d"].pk] == {"in": "✓", "k": 2, "a": 1, "c": 1.5}


@pytest.mark.django_db
def test_a_batch_spanning_tenants_reserves_in_one_statement_each_on_its_own_agents(
    tenant, other_tenant
):
    from django.db import connection as db
    from django.test.utils import CaptureQueriesContext

    wide_package(tenant, 4)
    wide_package(other_tenant, 3)
    mine = [make_agent(tenant, f"a{i}", max_concurrency=4) for i in range(2)]
    theirs = make_agent(other_tenant, "b", max_concurrency=2)  # room for 2 of its 3 tasks
    ids = ready_tasks(tenant) + ready_tasks(other_tenant)
    with CaptureQueriesContext(db) as queries:
        placed = place_tasks(sorted(ids, key=str), "server-1")
    statements = [q["sql"] for q in queries.captured_queries]
    # One reservation statement for both tenants, and no separate up-front lock.
    assert sum("INSERT INTO delivery_outbox" in sql for sql in statements) == 1
    assert not any(sql.lstrip().startswith("SELECT a.id FROM agents_agent a") for sql in statements)
    own = {t.pk: t.tenant_id for t in TaskExecution.objects.filter(pk__in=ids)}
    by_agent = Counter(p.agent_id for p in placed.values() if isinstance(p, Placed))
    assert by_agent == {mine[0].id: 2, mine[1].id: 2, theirs.id: 2}  # spread, each its own
    for task_execution_id, p in placed.items():
        if isinstance(p, Placed):
            agent = Agent.objects.get(pk=p.agent_id)
            assert agent.tenant_id == own[task_execution_id] == p.tenant_id
    waiting = [p for p in placed.values() if isinstance(p, NoAgent)]
    assert [(p.tenant_id, p.reason) for p in waiting] == [
        (other_tenant.pk, "the 1 live agent is at capacity")
    ]
    assert Agent.objects.get(pk=theirs.pk).in_flight == 2
    assert [Agent.objects.get(pk=a.pk).in_flight for a in mine] == [2, 2]


@pytest.mark.django_db
def test_a_batch_with_selectors_and_plain_tasks_locks_its_agents_once_up_front(tenant):
    from django.db import connection as db
    from django.test.utils import CaptureQueriesContext

    make_package(
        tenant,
        [
            {"id": "plain", "function": "demo.steps:noop"},
            {"id": "pinned", "function": "demo.steps:noop", "agent": "b"},
        ],
        SOURCE,
        name="mixed",
        workflow="mixed",
    )
    make_agent(tenant, "a", max_concurrency=4)
    b = make_agent(tenant, "b", max_concurrency=4)
    _execution, tasks = start(tenant, "mixed", {})
    with CaptureQueriesContext(db) as queries:
        placed = place_tasks([t.pk for t in tasks.values()], "server-1")
    statements = [q["sql"] for q in queries.captured_queries]
    locks = [i for i, sql in enumerate(statements) if "ORDER BY a.id FOR NO KEY UPDATE OF a" in sql]
    reserving = [i for i, sql in enumerate(statements) if "UPDATE agents_agent" in sql]
    # The first agent lock is the up-front one, before any reservation; the reservations
    # after it skip what others hold rather than wait (SKIP LOCKED).
    assert locks and reserving and locks[0] < reserving[0]
    assert statements[locks[0]].lstrip().startswith("SELECT a.id FROM agents_agent a")
    assert all("SKIP LOCKED" in statements[i] for i in reserving)
    assert placed[tasks["pinned"].pk].agent_id == b.id
    assert isinstance(placed[tasks["plain"].pk], Placed)


@pytest.mark.django_db
def test_a_batch_reads_its_executions_packages_in_one_statement(tenant):
    from django.test.utils import CaptureQueriesContext

    wide_package(tenant, 2)
    make_agent(tenant, "a", max_concurrency=16)
    ids = ready_tasks(tenant, executions=5)  # 10 tasks of 5 executions none placed before
    with CaptureQueriesContext(connection) as queries:
        placed = place_tasks(ids, "server-1")
    assert all(isinstance(p, Placed) for p in placed.values())
    package_reads = [q["sql"] for q in queries if "JOIN workflow_packages p" in q["sql"]]
    assert len(package_reads) == 1, package_reads
    package = TaskExecution.objects.get(pk=ids[0]).workflow_execution.package
    packets = DeliveryOutbox.objects.filter(task_execution_id__in=ids)
    assert packets.count() == 10
    assert {(r.payload["tenant"], r.payload["artifact_digest"]) for r in packets} == {
        (tenant.name, package.digest)
    }


@pytest.mark.django_db(transaction=True)
def test_placing_a_plain_task_costs_two_round_trips(tenant):
    """BEGIN goes out with the claim (which reads the context and the package too), COMMIT
    with the reservation and its packet: the idle pickup's placement."""
    from tests.support.round_trips import RoundTrips

    wide_package(tenant, 1)
    agent = make_agent(tenant, "a", max_concurrency=4)
    ids = ready_tasks(tenant)
    with RoundTrips() as traced:
        placed = place_tasks(ids, "server-1")
    assert [p.agent_id for p in placed.values()] == [agent.id]
    trips = traced.trips()
    assert len(trips) == 2, trips
    assert trips[0].count("Execute") == 2  # BEGIN + the claim
    assert trips[-1].count("Execute") == 2 and "Sync" in trips[-1]  # reservation + COMMIT
    row = DeliveryOutbox.objects.get(task_execution_id=ids[0])
    assert (row.agent_id, row.assignment) == (agent.id, 1)
    assert TaskExecution.objects.get(pk=ids[0]).status == "Running"


@pytest.mark.django_db(transaction=True)
def test_tasks_without_a_slot_are_never_claimed_and_told_why(tenant):
    """The batch only locks its tasks; the reservation statement writes the claim of each
    task it places, so a task it found no slot for stays Ready untouched (no attempt used,
    its assignment not bumped), and only its wait reason is written."""
    wide_package(tenant, 5)
    agent = make_agent(tenant, "a", max_concurrency=2)
    ids = ready_tasks(tenant)
    placed = place_tasks(ids, "server-1")
    got = [i for i, p in placed.items() if isinstance(p, Placed)]
    waiting = {i: p for i, p in placed.items() if isinstance(p, NoAgent)}
    assert len(got) == 2 and len(waiting) == 3
    assert {p.reason for p in waiting.values()} == {"the 1 live agent is at capacity"}
    rows = TaskExecution.objects.filter(pk__in=list(waiting)).values_list(
        "status", "attempt", "assignment", "wait_reason", "agent_id", "claimed_by"
    )
    assert set(rows) == {("Ready", 0, 0, "the 1 live agent is at capacity", None, "")}
    placed_rows = TaskExecution.objects.filter(pk__in=got).values_list(
        "status", "attempt", "assignment", "agent_id", "claimed_by"
    )
    assert set(placed_rows) == {("Running", 1, 1, agent.id, "server-1")}
    assert Agent.objects.get(pk=agent.pk).in_flight == 2
    assert not DeliveryOutbox.objects.filter(task_execution_id__in=list(waiting)).exists()
    # Still Ready, they are claimed like any Ready task once a slot is free.
    make_agent(tenant, "b", max_concurrency=4)
    again = place_tasks(list(waiting), "server-1")
    assert all(isinstance(p, Placed) for p in again.values())
    assert set(
        TaskExecution.objects.filter(pk__in=list(waiting)).values_list("attempt", "assignment")
    ) == {(1, 1)}
    assert {
        (r.assignment, r.payload["assignment"], r.payload["attempt"])
        for r in DeliveryOutbox.objects.filter(task_execution_id__in=list(waiting))
    } == {(1, 1, 1)}


def _task_updates() -> int:
    """Row versions written on the task table in this test's transaction."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT n_tup_upd FROM pg_stat_xact_user_tables WHERE relname = 'fleet_taskexecution'"
        )
        return cursor.fetchone()[0]


@pytest.mark.django_db
def test_a_placed_task_row_is_written_once_and_a_waiting_one_not_at_all(tenant):
    """The claim and the agent it names are one row version (they were two: the claim, then
    the reservation's agent); a task without a slot gets none (it got two: claim, release),
    and its wait reason is written once, not again while it keeps waiting for it."""
    wide_package(tenant, 6)
    make_agent(tenant, "a", max_concurrency=4)
    ids = ready_tasks(tenant)
    before = _task_updates()
    placed = place_tasks(ids, "server-1")
    assert sum(isinstance(p, Placed) for p in placed.values()) == 4
    assert _task_updates() - before == 4 + 2  # four claims with their agent, two wait reasons
    waiting = [i for i, p in placed.items() if isinstance(p, NoAgent)]
    before = _task_updates()
    assert all(isinstance(p, NoAgent) for p in place_tasks(waiting, "server-1").values())
    assert _task_updates() - before == 0  # same reason: nothing written


@pytest.mark.django_db(transaction=True)
def test_in_the_pipelined_transaction_a_task_no_agent_matches_fails_at_once(tenant):
    """A lone task with selectors nobody matches goes through the pipelined transaction (not
    a test's atomic block): it fails for good, through the result handler, and stays failed."""
    from tests.support.routing import agent, routed_package

    routed_package(tenant, tags=["tpu"], retries=3)
    agent(tenant, "w1", tags=["cpu"])
    _execution, tasks = start(tenant, "demo", {})
    placed = place_tasks([tasks["a"].pk], "server-1")
    assert isinstance(placed[tasks["a"].pk], Unroutable)
    task = TaskExecution.objects.get(pk=tasks["a"].pk)
    assert (task.status, task.attempt, task.error_type) == ("Failed", 1, "NoMatchingAgent")
