"""The dispatch loop on a real in-process executor: bursts, the tick, dedupe, quick retries."""

from __future__ import annotations

import asyncio
import time

import pytest

from fleet.engine.claims import due_ready_task_events
from fleet.engine.db_threads import DbThreadPool
from fleet.engine.dispatcher import Dispatcher
from fleet.engine.events import TaskReadyEvent
from fleet.engine.loop import EngineLoop, dispatch_concurrency
from fleet.executors.inprocess import InProcessExecutor
from fleet.models import TaskExecution, WorkflowExecution
from tests.support.factories import make_package
from tests.support.factories import start as start_execution

pytestmark = pytest.mark.django_db(transaction=True)

NOOP = "def f(ctx):\n    return {}\n"
FAIL_ONCE = """
import os


def f(ctx):
    if not os.path.exists(ctx["marker"]):
        open(ctx["marker"], "w").close()
        raise RuntimeError("first run fails")
    return {"ok": True}
"""


def dispatcher_for(tmp_path, workers: int = 2) -> Dispatcher:
    dispatcher = Dispatcher(claimer="loop-test")
    dispatcher.register_executor(
        "default", InProcessExecutor(workers=workers, claimer="loop-test", cache_root=tmp_path)
    )
    dispatcher.configure("default")
    return dispatcher


def ready_events() -> list[TaskReadyEvent]:
    return [TaskReadyEvent(*row) for row in due_ready_task_events(1000)]


def statuses() -> set[str]:
    return set(WorkflowExecution.objects.values_list("status", flat=True))


def completed_tasks() -> int:
    return TaskExecution.objects.filter(status="Completed").count()


async def run_until_done(dispatcher: Dispatcher, poll_s: float, offer, timeout_s: float = 20.0):
    """Start executor + loop, ``offer(loop)`` events, wait until every execution finished."""
    db = DbThreadPool(1, "loop-test")
    await dispatcher.executor.start()
    loop = EngineLoop(dispatcher, poll_s=poll_s)
    await loop.start()
    started = time.monotonic()
    try:
        await offer(loop, db)
        while time.monotonic() - started < timeout_s:
            # Done when every execution is, and the loop has counted each completed task: a
            # worker commits the outcome before it returns to the loop to be counted.
            if await db.call(statuses) == {"Completed"} and loop.stats["completed"] >= (
                await db.call(completed_tasks)
            ):
                return loop, time.monotonic() - started
            await asyncio.sleep(0.02)
        raise AssertionError(f"not done after {timeout_s}s: {await db.call(statuses)}")
    finally:
        await loop.stop()
        await dispatcher.executor.stop()
        await asyncio.to_thread(db.close)


def test_a_burst_beyond_capacity_drains_without_waiting_for_the_tick(tenant, tmp_path):
    make_package(tenant, [{"id": f"t{i}", "function": "demo.steps:f"} for i in range(10)], NOOP)
    for _ in range(3):
        start_execution(tenant, "demo")

    async def offer(loop, db):
        loop.offer(await db.call(ready_events))  # 30 events, 2 worker slots

    # The tick runs once at start and then not for a minute: only the fast path can finish this.
    loop, elapsed = asyncio.run(run_until_done(dispatcher_for(tmp_path), 60.0, offer))
    assert elapsed < 15
    assert loop.stats["completed"] == 30 and loop.stats["errors"] == 0


def test_the_tick_finds_ready_tasks_nobody_announced(tenant, tmp_path):
    make_package(tenant, [{"id": "a", "function": "demo.steps:f"}], NOOP)

    async def offer(loop, db):
        await db.call(start_execution, tenant, "demo")  # no event: only the database knows

    loop, _ = asyncio.run(run_until_done(dispatcher_for(tmp_path), 0.1, offer))
    assert loop.stats["completed"] == 1


def test_a_retry_without_backoff_is_offered_again_while_its_first_run_ends(tenant, tmp_path):
    make_package(tenant, [{"id": "a", "function": "demo.steps:f", "retries": 1}], FAIL_ONCE)
    start_execution(tenant, "demo", {"marker": str(tmp_path / "marker")})

    async def offer(loop, db):
        loop.offer(await db.call(ready_events))

    loop, elapsed = asyncio.run(run_until_done(dispatcher_for(tmp_path), 60.0, offer))
    assert elapsed < 10  # not a minute: the retry's event was kept, not dropped as a duplicate
    assert loop.stats["completed"] == 1
    assert TaskExecution.objects.get().attempt == 2


def test_duplicate_events_are_queued_once(tenant, tmp_path):
    make_package(tenant, [{"id": "a", "function": "demo.steps:f"}], NOOP)
    start_execution(tenant, "demo")
    event = ready_events()[0]

    async def scenario():
        # Executor not started: no capacity, so the event stays queued and held.
        loop = EngineLoop(dispatcher_for(tmp_path), poll_s=60.0, concurrency=2)
        await loop.start()
        try:
            added = [loop.offer([event]) for _ in range(5)]
            await asyncio.sleep(0.1)
            return added, loop.pending()
        finally:
            await loop.stop()

    added, pending = asyncio.run(scenario())
    assert added == [1, 0, 0, 0, 0] and pending == 1


def test_concurrency_follows_the_executor(tmp_path):
    assert dispatch_concurrency(dispatcher_for(tmp_path, workers=3)) == 12
