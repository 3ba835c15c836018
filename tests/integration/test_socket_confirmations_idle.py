"""A confirmation skipped behind a result's ack goes as soon as this process's results are
applied, not a retry round later; new confirmations keep their spacing under load (after a
round that carried several) and skip it when idle (after a round of one)
(fleet/executors/fleet/socket_writes.py)."""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from asgiref.sync import sync_to_async
from django.db import connection

from fleet.executors.fleet import socket_writes
from fleet.executors.fleet.delivery.placement import place_task
from fleet.models import DeliveryOutbox
from tests.support.agents import make_agent
from tests.support.factories import ready_root, two_task_package
from tests.support.loop import run_async
from tests.support.sockets import forget_sockets  # noqa: F401 (an autouse fixture)
from tests.support.waiting import until

pytestmark = pytest.mark.django_db(transaction=True)

FOREVER_S = 60.0  # a gap or a retry timer this long never fires during a test


def delivered_packets(tenant, count: int):
    """``count`` packets delivered to one agent and not confirmed: (agent, [row ids])."""
    two_task_package(tenant)
    agent = make_agent(tenant, connected=False)
    make_agent(tenant, "helper", max_concurrency=count)  # placement needs a live agent
    rows = []
    for _ in range(count):
        _, task = ready_root(tenant)
        place_task(task.pk, "s")
        rows.append(DeliveryOutbox.objects.get(task_execution=task).pk)
    DeliveryOutbox.objects.filter(pk__in=rows).update(agent=agent, state="delivered")
    return agent, rows


def confirmed(row_id: int) -> bool:
    return DeliveryOutbox.objects.filter(pk=row_id, received_at__isnull=False).exists()


def test_a_new_confirmation_after_a_round_of_several_waits_the_gap(tenant, monkeypatch):
    """Load: a round carried two confirmations, so the next one keeps the spacing (the
    nudge below lets only a lone retry skip it)."""
    agent, (first, second, third) = delivered_packets(tenant, 3)
    monkeypatch.setattr(socket_writes, "MIN_ROUND_GAP_S", FOREVER_S)

    async def scenario():
        writes = socket_writes.writer()
        try:
            writes.received(agent.id, [first, second])
            await until(lambda: confirmed(first) and confirmed(second), timeout=10)
            writes.results_applied()  # nothing to retry: no effect
            writes.received(agent.id, [third])
            await asyncio.sleep(0.5)  # silence is what is asserted: nothing to wait for
        finally:
            await socket_writes.close_writer()

    run_async(scenario())
    assert not confirmed(third)


def test_a_new_confirmation_after_a_round_of_one_goes_at_once(tenant, monkeypatch):
    """Idle (one client starting one task at a time): the gap would gather nothing and
    only add to the next pickup's latency, so the round after a round of one skips it."""
    agent, (first, second) = delivered_packets(tenant, 2)
    monkeypatch.setattr(socket_writes, "MIN_ROUND_GAP_S", FOREVER_S)

    async def scenario():
        writes = socket_writes.writer()
        try:
            writes.received(agent.id, [first])
            await until(lambda: confirmed(first), timeout=10)
            writes.received(agent.id, [second])
            await until(lambda: confirmed(second), timeout=10)
        finally:
            await socket_writes.close_writer()

    run_async(scenario())
    assert confirmed(second)


def _dsn() -> dict:
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    return {**params, "autocommit": False}


def test_a_confirmation_skipped_behind_an_ack_goes_when_results_are_applied(tenant, monkeypatch):
    """The row is locked (as a result batch acking it would) when the confirmation comes:
    skipped; once the lock is gone, results_applied() has it written at once: neither the
    retry timer nor the spacing after the skipped round holds it."""
    agent, (row,) = delivered_packets(tenant, 1)
    monkeypatch.setattr(socket_writes, "RECEIVED_RETRY_S", FOREVER_S)
    monkeypatch.setattr(socket_writes, "MIN_ROUND_GAP_S", FOREVER_S)

    async def scenario():
        holder = await psycopg.AsyncConnection.connect(**_dsn())
        writes = socket_writes.writer()
        try:
            try:
                await holder.execute(
                    "SELECT 1 FROM delivery_outbox WHERE id = %s FOR UPDATE", [row]
                )
                writes.received(agent.id, [row])
                await until(lambda: writes.retrying == 1, timeout=10)
                skipped = not await sync_to_async(confirmed)(row)
            finally:
                await holder.rollback()
                await holder.close()
            writes.results_applied()
            await until(lambda: confirmed(row), timeout=10)
            return skipped, writes.retrying
        finally:
            await socket_writes.close_writer()

    skipped, retrying = run_async(scenario())
    assert skipped, "the confirmation was written while its row was locked"
    assert retrying == 0
