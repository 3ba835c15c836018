"""Overflow fairness: tenants take turns, then priority, then age; the backlog limit.

Here: the unit tests (no database, socket or process); the rest are in tests/integration/test_routing_fairness.py.
"""

from __future__ import annotations

import asyncio
import uuid

from fleet.engine.events import TaskReadyEvent
from fleet.engine.fair_queue import FairQueue


def event(tenant: int, priority: int = 0, execution: uuid.UUID | None = None, name: str = "t"):
    return TaskReadyEvent(uuid.uuid4(), execution or uuid.uuid4(), name, 1, tenant, priority)


def drain(queue: FairQueue) -> list[TaskReadyEvent]:
    async def take_all():
        return [await queue.get() for _ in range(len(queue))]

    return asyncio.run(take_all())


def test_tenants_take_turns_whatever_their_backlog():
    queue = FairQueue()
    for _ in range(1000):
        queue.put_nowait(event(1))
    for _ in range(10):
        queue.put_nowait(event(2))
    taken = [e.tenant_id for e in drain(queue)]
    assert taken[:20] == [1, 2] * 10  # tenant 2's ten are all out within the first 20
    assert taken[20:] == [1] * 990


def test_within_a_tenant_the_higher_priority_goes_first_then_the_older():
    queue = FairQueue()
    low_a, low_b = uuid.uuid4(), uuid.uuid4()
    queue.put_nowait(event(1, 0, low_a, "low-a1"))
    queue.put_nowait(event(1, 0, low_a, "low-a2"))
    queue.put_nowait(event(1, 0, low_b, "low-b1"))
    queue.put_nowait(event(1, 5, name="urgent"))
    queue.put_nowait(event(1, -3, name="whenever"))
    queue.put_nowait(event(1, 5, name="urgent-2"))
    names = [e.task_name for e in drain(queue)]
    # Executions of one priority take turns (oldest first); the negative priority is last.
    assert names == ["urgent", "urgent-2", "low-a1", "low-b1", "low-a2", "whenever"]


def test_priority_does_not_let_one_tenant_starve_another():
    queue = FairQueue()
    for _ in range(5):
        queue.put_nowait(event(1, priority=100))
    queue.put_nowait(event(2, priority=0))
    assert [e.tenant_id for e in drain(queue)][:2] == [1, 2]


def test_events_without_a_tenant_still_take_turns_by_execution():
    a, b = uuid.uuid4(), uuid.uuid4()
    queue = FairQueue()
    for name in "abc":
        queue.put_nowait(TaskReadyEvent(uuid.uuid4(), a, name, 1))
    queue.put_nowait(TaskReadyEvent(uuid.uuid4(), b, "x", 1))
    assert [e.task_name for e in drain(queue)] == ["a", "x", "b", "c"]
