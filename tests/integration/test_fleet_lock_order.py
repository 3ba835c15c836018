"""The lock order (docs/fleet.md, "Lock order"): placement batches spanning many tenants
and result batches freeing slots all over the fleet, run at once from several
connections, never deadlock — PostgreSQL's own deadlock counter for the test database
(``pg_stat_database.deadlocks``) does not move."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from django.db import connection

from agents.models import Agent
from fleet.executors.fleet.delivery.batch_placement import place_tasks
from fleet.executors.fleet.delivery.placement import Placed
from fleet.executors.fleet.result_intake import ResultIn, apply_results
from fleet.models import DeliveryOutbox, TaskExecution, Tenant
from tests.support.agents import make_agent
from tests.support.factories import make_package, start

SOURCE = "def noop(context):\n    return None\n"
TENANTS = 12
AGENTS_PER_TENANT = 6
WIDTH = 6  # tasks per execution, all Ready at once
ROUNDS = 4  # executions per tenant
PLACERS = 3
REPORTERS = 3
BATCH = 40


def _deadlocks() -> int:
    """The database's deadlock counter, read afresh (a new snapshot of the statistics)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        return cursor.fetchone()[0]


def _flush_statistics() -> None:
    """Make this backend add its pending statistics (a deadlock it was the victim of) to
    the shared counters now: a pooled connection's backend does not exit, and an idle
    one flushes only seconds later.  The flush runs when the backend goes idle after the
    first statement, so it has happened once the second returns."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT 1")


class _Work:
    """The shared state of the racing threads: Ready task ids to place, and when to stop."""

    def __init__(self, ready: list[uuid.UUID], expected: int) -> None:
        self.lock = threading.Lock()
        self.ready = ready
        self.expected = expected
        self.errors: list[BaseException] = []
        self.deadline = time.monotonic() + 240

    def take(self) -> list[uuid.UUID]:
        with self.lock:
            chunk, self.ready = self.ready[:BATCH], self.ready[BATCH:]
            return chunk

    def give_back(self, ids: list[uuid.UUID]) -> None:
        with self.lock:
            self.ready.extend(ids)

    def done(self) -> bool:
        return (
            bool(self.errors)
            or time.monotonic() > self.deadline
            or (TaskExecution.objects.filter(status="Completed").count() >= self.expected)
        )


def _thread(work: _Work, body) -> threading.Thread:
    def run() -> None:
        try:
            while not work.done():
                body()
            _flush_statistics()
        except BaseException as exc:  # reported by the test
            work.errors.append(exc)
        finally:
            connection.close()

    return threading.Thread(target=run)


def _placer(work: _Work):
    def body() -> None:
        chunk = work.take()
        if not chunk:
            time.sleep(0.01)  # nothing Ready yet: the reporters free slots
            return
        placed = place_tasks(chunk, "server-1")
        work.give_back([t for t, p in placed.items() if not isinstance(p, Placed)])

    return body


def _reporter(work: _Work, index: int):
    def body() -> None:
        rows = list(
            DeliveryOutbox.objects.filter(state__in=("pending", "delivered"))
            .extra(where=["id %% %s = %s"], params=[REPORTERS, index])
            .values_list("id", "tenant_id", "agent_id", "task_execution_id", "assignment")[:BATCH]
        )
        if not rows:
            time.sleep(0.01)
            return
        items = [
            (tenant_id, agent_id, ResultIn(outbox_id=row_id, task_execution_id=task,
                                            assignment=assignment, outcome="success", output={}))
            for row_id, tenant_id, agent_id, task, assignment in rows
        ]  # fmt: skip
        apply_results(items)

    return body


@pytest.mark.django_db(transaction=True)
def test_multi_tenant_placement_and_result_batches_never_deadlock():
    tenants = [Tenant.objects.create(name=f"lock-order-{i}") for i in range(TENANTS)]
    ready: list[uuid.UUID] = []
    for tenant in tenants:
        tasks = [{"id": f"t{i}", "function": "demo.steps:noop"} for i in range(WIDTH)]
        make_package(tenant, tasks, SOURCE, name="wide", workflow="wide")
        for i in range(AGENTS_PER_TENANT):
            make_agent(tenant, f"{tenant.name}-a{i}", max_concurrency=3)
        for _ in range(ROUNDS):
            _execution, started = start(tenant, "wide", {})
            ready += [t.pk for t in started.values() if t.status == "Ready"]
    # Interleave the tenants in every batch: each placement batch spans many of them.
    ready.sort(key=str)
    expected = len(ready)
    assert expected == TENANTS * WIDTH * ROUNDS
    before = _deadlocks()

    work = _Work(ready, expected)
    threads = [_thread(work, _placer(work)) for _ in range(PLACERS)]
    threads += [_thread(work, _reporter(work, i)) for i in range(REPORTERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not work.errors, work.errors

    assert TaskExecution.objects.filter(status="Completed").count() == expected
    assert set(Agent.objects.values_list("in_flight", flat=True)) == {0}
    assert not DeliveryOutbox.objects.exclude(state="acked").exists()
    # Each racing thread flushed its backend's statistics (_flush_statistics).
    assert _deadlocks() == before
