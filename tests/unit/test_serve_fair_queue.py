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


class _CountingFuture(asyncio.Future):
    """Counts how often anyone asks a waiting getter whether it was woken already."""

    checks = 0

    def done(self) -> bool:
        _CountingFuture.checks += 1
        return super().done()


def test_a_put_looks_at_one_idle_getter_not_at_every_one_woken_before():
    # The tick offers a backlog to ~1,000 idle dispatch workers at once: each put must
    # wake the next getter without walking past the ones it woke already (O(n) a put,
    # O(n²) the offer, with asyncio.Semaphore).
    getters, offered = 200, 400

    async def scenario():
        loop = asyncio.get_running_loop()
        loop.create_future = lambda: _CountingFuture(loop=loop)
        queue = FairQueue()
        workers = [asyncio.create_task(queue.get()) for _ in range(getters)]
        await asyncio.sleep(0)
        _CountingFuture.checks = 0
        for event in events(uuid.uuid4(), "x" * offered):
            queue.put_nowait(event)
        checks = _CountingFuture.checks
        taken = await asyncio.gather(*workers)
        return checks, len(taken), len(queue)

    checks, taken, left = asyncio.run(scenario())
    assert checks <= offered
    assert (taken, left) == (getters, offered - getters)


def test_a_getter_woken_then_cancelled_passes_its_event_on():
    async def scenario():
        queue = FairQueue()
        first = asyncio.create_task(queue.get())
        second = asyncio.create_task(queue.get())
        await asyncio.sleep(0)
        (event,) = events(uuid.uuid4(), "z")
        queue.put_nowait(event)  # wakes `first`, which is cancelled before it runs
        first.cancel()
        got = await asyncio.wait_for(second, 1)
        return got is event, first.cancelled(), len(queue)

    assert asyncio.run(scenario()) == (True, True, 0)
