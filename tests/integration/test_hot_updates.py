"""The hot tables keep room on their pages, so the updates that change no indexed column
stay heap-only (HOT): no index entry per update (fleet migration 0020, docs/performance.md
"Round i17-db").  Without the room, a full page sends the new version to another page and
every index of the table gets an entry."""

from __future__ import annotations

import pytest
from django.db import connection

from fleet.executors.fleet.state import ledger
from fleet.models import DeliveryOutbox, TaskExecution
from tests.support.agents import make_agent
from tests.support.factories import make_ready_tasks

pytestmark = pytest.mark.django_db

ROWS = 200  # several pages of each table, so that a page fills up
# A packet's payload about the size fleetbench's are (~600 bytes a row).
PAYLOAD = {"context_json": "x" * 400, "function": "demo.steps:noop", "tenant": "acme"}


def _hot_updates(table: str) -> tuple[int, int]:
    """(updates, HOT updates) of ``table`` in this test's transaction."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables WHERE relname = %s",
            [table],
        )
        return cursor.fetchone()


def _packets(tenant) -> tuple[list[TaskExecution], list[DeliveryOutbox], object]:
    make_ready_tasks(tenant, ROWS)
    agent = make_agent(tenant, "a1")
    tasks = list(TaskExecution.objects.filter(tenant=tenant).order_by("id"))
    packets = DeliveryOutbox.objects.bulk_create(
        DeliveryOutbox(
            tenant=tenant,
            agent=agent,
            task_execution=t,
            assignment=t.assignment,
            state="delivered",
            payload=PAYLOAD,
        )
        for t in tasks
    )
    return tasks, packets, agent


def test_a_packets_confirmation_is_a_heap_only_update(tenant):
    _, packets, agent = _packets(tenant)
    before = _hot_updates(ledger.OUTBOX)
    with connection.cursor() as cursor:
        cursor.execute(
            ledger.RECEIVED_MANY,
            {"agents": [agent.pk] * len(packets), "ids": [p.pk for p in packets]},
        )
        assert cursor.rowcount == ROWS
    updates, hot = (a - b for a, b in zip(_hot_updates(ledger.OUTBOX), before, strict=True))
    assert updates == ROWS
    assert hot >= ROWS * 0.9  # at fillfactor 100: only the last page's few rows


def test_a_tasks_agent_is_a_heap_only_update(tenant):
    tasks, _, agent = _packets(tenant)
    before = _hot_updates("fleet_taskexecution")
    with connection.cursor() as cursor:
        # The reservation's `assigned` update: the agent and the result deadline.
        cursor.execute(
            "UPDATE fleet_taskexecution SET agent_id = %s, result_deadline = now() "
            "WHERE id = ANY(%s::uuid[])",
            [agent.pk, [t.pk for t in tasks]],
        )
    updates, hot = (a - b for a, b in zip(_hot_updates("fleet_taskexecution"), before, strict=True))
    assert updates == ROWS
    # A page keeps room for about a third of its rows' new versions (fillfactor 70); at
    # fillfactor 100 only the last page's few rows are HOT.
    assert hot >= ROWS / 4
