"""The dispatch loop's queue takes executions in turn (fairness, less row-lock contention)."""

from __future__ import annotations

import asyncio
import uuid

from fleet.engine.events import TaskReadyEvent
from fleet.engine.fair_queue import FairQueue


def events(execution: uuid.UUID, names: str) -> list[TaskReadyEvent]:
    return [TaskReadyEvent(uuid.uuid4(), execution, name, 1) for name in names]


def test_it_takes_one_event_per_execution_in_turn():
    a, b, c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()

    async def scenario():
        queue = FairQueue()
        for event in events(a, "abcd") + events(b, "xy") + events(c, "q"):
            queue.put_nowait(event)
        assert len(queue) == 7
        taken = [(await queue.get()).task_name for _ in range(7)]
        return taken, len(queue)

    taken, left = asyncio.run(scenario())
    assert taken == ["a", "x", "q", "b", "y", "c", "d"]
    assert left == 0


def test_a_getter_waits_for_the_next_event():
    async def scenario():
        queue = FairQueue()
        getter = asyncio.create_task(queue.get())
        await asyncio.sleep(0.01)
        assert not getter.done()
        (event,) = events(uuid.uuid4(), "z")
        queue.put_nowait(event)
        return await asyncio.wait_for(getter, 1)

    assert asyncio.run(scenario()).task_name == "z"
