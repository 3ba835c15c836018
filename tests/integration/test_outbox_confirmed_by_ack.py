"""A packet's row versions on the hot path (docs/performance.md, "Round i17-cpu (session 16)"):
an outcome's ack writes the confirmation (``received_at``) that was not written yet, the
socket writer holds a confirmation back while its outcome is on its way and drops it once
the outcome is applied, and the relays' NOTIFY trigger runs only for rows that become
pending."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from django.db import connection, transaction
from django.utils import timezone

from fleet.executors.fleet import socket_writes
from fleet.executors.fleet.result_intake import apply_results
from fleet.executors.fleet.state import ledger
from fleet.models import DeliveryOutbox, TaskExecution
from tests.support.agents import make_agent
from tests.support.factories import make_package, make_ready_tasks, start
from tests.support.outcomes import delivered_tasks, result_in

SOURCE = "def noop(context):\n    return None\n"


@pytest.fixture
def placed(tenant):
    """Three tasks placed on one agent, their packets delivered and not yet confirmed."""
    tasks = [{"id": f"t{i}", "function": "demo.steps:noop"} for i in range(3)]
    make_package(tenant, tasks, SOURCE, name="three", workflow="three")
    agent = make_agent(tenant, "a", max_concurrency=4)
    execution, _tasks = start(tenant, "three", {})
    return agent, delivered_tasks(execution)


@pytest.mark.django_db
def test_an_outcome_confirms_a_packet_no_confirmation_reached(tenant, placed):
    agent, pairs = placed
    confirmed_at = timezone.now().replace(year=2030)
    first = pairs[0][1]
    DeliveryOutbox.objects.filter(pk=first.pk).update(received_at=confirmed_at)
    answers = apply_results([(tenant.pk, agent.id, result_in(task, row)) for task, row in pairs])
    assert answers == [(200, {"applied": True, "reason": ""})] * 3
    rows = {row.pk: row for row in DeliveryOutbox.objects.all()}
    assert {row.state for row in rows.values()} == {"acked"}
    assert all(row.received_at is not None for row in rows.values())
    assert rows[first.pk].received_at == confirmed_at  # a confirmation written is kept
    # The confirmations arriving after the outcome find nothing to write.
    with connection.cursor() as cursor:
        cursor.execute(
            ledger.RECEIVED_MANY, {"agents": [agent.id] * 3, "ids": [row.pk for _t, row in pairs]}
        )
        assert cursor.fetchall() == []


@pytest.mark.django_db
def test_a_lone_outcome_confirms_its_packet_too(tenant, placed):
    agent, pairs = placed
    task, row = pairs[0]  # alone in its batch: the per-row path
    assert apply_results([(tenant.pk, agent.id, result_in(task, row))]) == [
        (200, {"applied": True, "reason": ""})
    ]
    row.refresh_from_db()
    assert row.state == "acked" and row.received_at is not None


def _write_rounds(writes: socket_writes.SocketWrites, monkeypatch) -> list[list]:
    """Every confirmation list the writer sends to the database (nothing is written)."""
    sent: list[list] = []

    async def mark(conn, received):
        sent.append(list(received))
        return {outbox_id for _agent, outbox_id in received}

    async def connection_(self):
        return None

    monkeypatch.setattr(socket_writes.SocketWrites, "_mark_received", staticmethod(mark))
    monkeypatch.setattr(socket_writes.SocketWrites, "_connection", connection_)
    return sent


def test_the_writer_drops_the_confirmations_of_packets_whose_outcomes_committed(monkeypatch):
    agent = uuid.uuid4()

    async def scenario() -> list[list]:
        writes = socket_writes.writer()
        sent = _write_rounds(writes, monkeypatch)
        # The outcomes of 1 and 3 commit before the writer's next round.
        writes.received(agent, [1, 2, 3])
        writes.results_applied([(agent, 1), (agent, 3)])
        for _ in range(50):
            if sent:
                break
            await asyncio.sleep(0.01)
        # A round whose every confirmation was settled sends no statement at all.
        writes.received(agent, [4])
        writes.results_applied([(agent, 4)])
        await asyncio.sleep(0.05)
        await socket_writes.close_writer()
        return sent

    assert asyncio.run(scenario()) == [[(agent, 2)]]


def test_a_confirmation_waits_for_an_outcome_on_its_way_and_is_written_if_not_applied(
    monkeypatch,
):
    agent = uuid.uuid4()

    async def scenario() -> tuple[list[list], list[list]]:
        writes = socket_writes.writer()
        sent = _write_rounds(writes, monkeypatch)
        writes.received(agent, [1, 2])
        writes.outcome_coming([(agent, 1), (agent, 2)])  # both results arrived meanwhile
        await asyncio.sleep(0.05)
        while_coming = list(sent)
        # 1 was applied (its ack confirmed it); 2 was not (stale, refused, a failed batch).
        writes.results_applied([(agent, 1)], [(agent, 2)])
        for _ in range(50):
            if sent:
                break
            await asyncio.sleep(0.01)
        await socket_writes.close_writer()
        return while_coming, sent

    while_coming, sent = asyncio.run(scenario())
    assert while_coming == []
    assert sent == [[(agent, 2)]]


@pytest.mark.django_db(transaction=True)
def test_the_notify_trigger_runs_only_for_rows_that_become_pending(tenant):
    make_ready_tasks(tenant, 4)
    agent = make_agent(tenant, "a1")
    tasks = list(TaskExecution.objects.filter(tenant=tenant).order_by("id"))

    def trigger_calls(write) -> int:
        """Calls of the trigger's function by ``write`` (the backend's counts not yet
        published: read before and after, in the write's transaction)."""
        count = (
            "SELECT coalesce(pg_stat_get_xact_function_calls('delivery_outbox_notify'::regproc), 0)"
        )
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL track_functions = 'pl'")
            cursor.execute(count)
            before = cursor.fetchone()[0]
            write()
            cursor.execute(count)
            return cursor.fetchone()[0] - before

    def packets(state: str, chosen: list[TaskExecution]) -> None:
        DeliveryOutbox.objects.bulk_create(
            DeliveryOutbox(
                tenant=tenant,
                agent=agent,
                task_execution=t,
                assignment=t.assignment,
                state=state,
                payload={},
            )
            for t in chosen
        )

    # A local agent's placed packets (delivered) and their acks: no call.
    assert trigger_calls(lambda: packets("delivered", tasks[:2])) == 0
    assert trigger_calls(lambda: DeliveryOutbox.objects.update(state="acked")) == 0
    # Rows that become pending (a remote agent's placement, a redelivery) still wake a relay.
    assert trigger_calls(lambda: packets("pending", tasks[2:])) == 2
    assert (
        trigger_calls(lambda: DeliveryOutbox.objects.filter(state="acked").update(state="pending"))
        == 2
    )
