"""A lone placement in one statement on the event loop's connection
(fleet/executors/fleet/delivery/one_trip.py): the same packet, row and slot as the usual
placement, one round trip, and nothing written for a task the statement does not take."""

from __future__ import annotations

import re

import pytest

from agents.models import Agent
from fleet.engine.context import build_task_context, encode_context
from fleet.executors.fleet.delivery import one_trip
from fleet.executors.fleet.delivery.batch_placement import place_tasks
from fleet.executors.fleet.delivery.pg import connect_async
from fleet.executors.fleet.delivery.placement import Delivered, Placed
from fleet.models import DeliveryOutbox, TaskExecution, WorkflowExecution
from tests.support.agents import make_agent
from tests.support.factories import make_package, start
from tests.support.loop import run_async
from tests.support.round_trips import RoundTrips

pytestmark = pytest.mark.django_db(transaction=True)

SOURCE = "def noop(context):\n    return None\n"
# Every kind of value the statement encodes itself, with the escapes that differ most
# between encoders: quotes, backslashes, control characters, non-ASCII, a key order that
# is not the insertion order.
TRICKY = {
    "zeta": 'quote " backslash \\ newline \n tab \t bell \u0007 del \u007f',
    "a": "é ü 中文 \u2028 emoji 🙂",
    "n": -1234567890123,
    "zero": 0,
    "yes": True,
    "no": False,
    "none": None,
    'clé "x"': "",
}


def one_task(tenant, context=None, workflow: str = "lone", package: bool = True, **task_extra):
    """The root task of a new execution of ``workflow`` (its package made unless not
    ``package``: a second execution of the same one)."""
    if package:
        tasks = [{"id": "t0", "function": "demo.steps:noop", **task_extra}]
        make_package(tenant, tasks, SOURCE, name=workflow, workflow=workflow)
    _execution, by_id = start(tenant, workflow, context or {})
    return by_id["t0"]


def place_on_loop(task, tenant_id: int, trips: list | None = None):
    async def scenario():
        conn = await connect_async("test-one-trip")
        try:
            if trips is None:
                return await one_trip.place_one(conn, task.pk, tenant_id, "server-1")
            with RoundTrips(conn.pgconn) as traced:
                placed = await one_trip.place_one(conn, task.pk, tenant_id, "server-1")
            trips.extend(traced.trips())
            return placed
        finally:
            await conn.close()

    return run_async(scenario())


def _without_ids(payload: dict) -> dict:
    return {
        k: v for k, v in payload.items() if k not in ("task_execution_id", "workflow_execution_id")
    }


@pytest.mark.parametrize("context", [{}, {"x": 1}, TRICKY], ids=["empty", "one", "tricky"])
def test_the_packet_and_row_are_the_usual_placements_byte_for_byte(tenant, context):
    agent = make_agent(tenant, "a", max_concurrency=4)
    lone = one_task(tenant, context)
    usual = one_task(tenant, context, package=False)
    placed = place_on_loop(lone, tenant.id)
    usual_placed = place_tasks([usual.pk], "server-1")[usual.pk]
    assert isinstance(placed, Delivered) and isinstance(usual_placed, Delivered)
    assert placed.agent_id == agent.id
    row = DeliveryOutbox.objects.get(task_execution_id=lone.pk)
    usual_row = DeliveryOutbox.objects.get(task_execution_id=usual.pk)
    # the shared builder's exact bytes, stored and pushed
    expected = encode_context(build_task_context(lone.pk))
    assert row.payload["context_json"] == placed.packet["context_json"] == expected
    assert _without_ids(row.payload) == _without_ids(usual_row.payload)
    assert placed.packet == {**row.payload, "outbox_id": row.id}
    assert _without_ids(placed.packet) == {**_without_ids(usual_placed.packet), "outbox_id": row.id}
    assert (row.state, row.attempts, row.assignment) == ("delivered", 1, placed.assignment)
    assert row.delivered_at is not None and row.received_at is None
    task = TaskExecution.objects.get(pk=lone.pk)
    assert (task.status, task.attempt, task.assignment, task.agent_id) == (
        "Running",
        1,
        1,
        agent.id,
    )
    assert task.claimed_by == "server-1" and task.result_deadline is not None
    assert WorkflowExecution.objects.get(pk=task.workflow_execution_id).status == "Running"
    agent.refresh_from_db()
    assert agent.in_flight == 2


def test_a_lone_placement_is_one_round_trip(tenant):
    make_agent(tenant, "a", max_concurrency=4)
    task = one_task(tenant, {"k": "v"})
    trips: list = []
    placed = place_on_loop(task, tenant.id, trips)
    assert isinstance(placed, Delivered)
    assert len(trips) == 1, trips
    assert trips[0].count("Execute") == 1 and "Sync" in trips[0]


def test_an_agent_of_another_server_gets_a_pending_row(tenant):
    agent = make_agent(tenant, "remote", connected="another-server")
    task = one_task(tenant)
    placed = place_on_loop(task, tenant.id)
    assert type(placed) is Placed and placed.agent_id == agent.id
    row = DeliveryOutbox.objects.get(task_execution_id=task.pk)
    assert (row.state, row.attempts, row.delivered_at) == ("pending", 0, None)
    assert TaskExecution.objects.get(pk=task.pk).result_deadline is None


def _untouched(task, agents) -> None:
    row = TaskExecution.objects.get(pk=task.pk)
    assert (row.status, row.attempt, row.assignment, row.agent_id) == ("Ready", 0, 0, None)
    assert not DeliveryOutbox.objects.filter(task_execution_id=task.pk).exists()
    assert WorkflowExecution.objects.get(pk=task.workflow_execution_id).status == "Pending"
    assert [a.in_flight for a in Agent.objects.filter(pk__in=[a.pk for a in agents])] == [
        a.in_flight for a in agents
    ]


@pytest.mark.parametrize(
    "context,extra",
    [
        ({"f": 1.5}, {}),  # a float: Python's repr is not the stored text
        ({"o": {"x": 1}}, {}),  # nested
        ({"big": 10**20}, {}),  # an integer past 18 digits
        ({}, {"agent": "a"}),  # a selector (the agent it names is there)
    ],
    ids=["float", "nested", "big-int", "selectors"],
)
def test_a_task_the_statement_cannot_build_is_left_untouched(tenant, context, extra):
    agents = [make_agent(tenant, "a", max_concurrency=4)]
    task = one_task(tenant, context, **extra)
    assert place_on_loop(task, tenant.id) is None
    _untouched(task, agents)
    # … and the usual path places it
    assert isinstance(place_tasks([task.pk], "server-1")[task.pk], Placed)


def test_no_free_slot_writes_nothing(tenant):
    agents = [make_agent(tenant, "full", max_concurrency=1, in_flight=1)]
    task = one_task(tenant)
    assert place_on_loop(task, tenant.id) is None
    _untouched(task, agents)


def test_another_tenants_task_is_not_taken(tenant, other_tenant):
    make_agent(other_tenant, "theirs", max_concurrency=4)
    agents = [make_agent(tenant, "mine", max_concurrency=4)]
    task = one_task(tenant)
    assert place_on_loop(task, other_tenant.id) is None
    _untouched(task, agents)


def test_the_pushed_triple_artifact_and_context_are_the_rows_as_written(tenant):
    """What a trigger (a misbehaving server, in the e2e tests) wrote into the row is what is
    pushed: the packet pushed is the packet stored."""
    from django.db import connection

    make_agent(tenant, "a", max_concurrency=4)
    task = one_task(tenant, {"k": "v"})
    with connection.cursor() as cursor:
        cursor.execute(
            """
            CREATE FUNCTION test_tamper() RETURNS trigger AS $$
            BEGIN
                NEW.payload := NEW.payload
                    || '{"target_triple": "other", "artifact_digest": "x", "context_json": "{}"}';
                RETURN NEW;
            END; $$ LANGUAGE plpgsql;
            CREATE TRIGGER test_tamper BEFORE INSERT ON delivery_outbox
                FOR EACH ROW EXECUTE FUNCTION test_tamper();
            """
        )
    try:
        placed = place_on_loop(task, tenant.id)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER test_tamper ON delivery_outbox")
            cursor.execute("DROP FUNCTION test_tamper()")
    assert isinstance(placed, Delivered)
    assert (placed.packet["target_triple"], placed.packet["artifact_digest"]) == ("other", "x")
    assert placed.packet["context_json"] == "{}"
    row = DeliveryOutbox.objects.get(task_execution_id=task.pk)
    assert placed.packet == {**row.payload, "outbox_id": row.id}


def test_every_row_is_reached_by_its_key_in_the_plan_the_loop_keeps(tenant):
    """The loop's connection keeps a generic plan (psycopg prepares the statement after a few
    runs).  Its task, execution and agent rows are reached by primary key, not through the
    tenant's Ready tasks or a scan of every execution (a young database's statistics once
    planned that: 3–4 ms a pickup; and with the tenant's Ready tasks indexed by status, a
    task found among them is as slow as the backlog is long)."""
    import psycopg

    from fleet.executors.fleet.delivery.pg import connection_params

    make_agent(tenant, "a", max_concurrency=4)
    for _ in range(20):  # other executions and Ready tasks of the tenant
        one_task(tenant, package=False) if _ else one_task(tenant)
    task = one_task(tenant, package=False)
    params = one_trip.params(task.pk, tenant.id, "server-1")
    with psycopg.connect(**connection_params(), autocommit=True) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        # A table of a page or two is rightly scanned whole whatever the query; what must not
        # happen is another index, or a scan the size of the history, so scans are ruled out.
        conn.execute("SET enable_seqscan = off")
        conn.execute(one_trip._STATEMENT, params, prepare=True)  # placed, and prepared
        (name,) = conn.execute("SELECT name FROM pg_prepared_statements").fetchone()
        order = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", one_trip._STATEMENT)))
        cursor = psycopg.ClientCursor(conn)
        cursor.execute(f"EXPLAIN EXECUTE {name}({', '.join(f'%({k})s' for k in order)})", params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    scans = re.findall(r"(Seq Scan|Index Scan using \w+|Bitmap Heap Scan) on (\w+)", plan)
    by_table = {table: {how for how, t in scans if t == table} for _how, table in scans}
    assert by_table["fleet_taskexecution"] == {"Index Scan using fleet_taskexecution_pkey"}, plan
    assert by_table["fleet_workflowexecution"] == {
        "Index Scan using fleet_workflowexecution_pkey"
    }, plan


def _on_placer(scenario):
    """Run ``scenario(placer)`` with a fresh loop placer, closed afterwards."""

    async def run():
        placer = one_trip.LoopPlacer("server-1")
        try:
            return await scenario(placer)
        finally:
            await placer.close()

    return run_async(run())


async def _plans(placer) -> list[tuple[int, int]]:
    conn = await placer._connection()
    cursor = await conn.execute(
        "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
        " WHERE statement LIKE '%%INSERT INTO delivery_outbox%%'"
        " AND statement NOT LIKE '%%pg_prepared_statements%%'"
    )
    return await cursor.fetchall()


def test_the_placer_keeps_a_generic_plan_from_its_first_placement(tenant):
    """psycopg prepared the statement only at its sixth run and PostgreSQL then planned it
    for its parameters five more times (1.2–1.4 ms a plan): the loop's connection prepares
    it at once and keeps the generic plan (which reaches every row by key, above)."""
    make_agent(tenant, "a", max_concurrency=4)
    task = one_task(tenant)

    async def scenario(placer):
        placed = await placer.place(task.pk, tenant.id)
        return placed, await _plans(placer)

    placed, plans = _on_placer(scenario)
    assert isinstance(placed, Delivered)
    assert plans == [(1, 0)]


def test_warming_the_placer_writes_nothing_and_plans_the_statement(tenant):
    agents = [make_agent(tenant, "a", max_concurrency=4)]
    task = one_task(tenant)

    async def warm(placer):
        await placer.warm()
        return await _plans(placer)

    assert _on_placer(warm) == [(1, 0)]
    _untouched(task, agents)

    async def warm_then_place(placer):
        await placer.warm()
        placed = await placer.place(task.pk, tenant.id)
        return placed, await _plans(placer)

    placed, plans = _on_placer(warm_then_place)
    assert isinstance(placed, Delivered)
    assert plans == [(2, 0)]  # the warmed statement is the one that placed
