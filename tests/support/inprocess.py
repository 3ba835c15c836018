"""Drive executions through a real InProcessExecutor in tests: execute → ready events → execute …

Newly Ready tasks come back through :mod:`fleet.engine.ready_queue` (captured
here as the server's dispatch loop would); tasks that become due later (a
retry with backoff) are found by polling, as the scheduler tick does.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from contextlib import contextmanager

from fleet.engine import ready_queue
from fleet.engine.claims import due_ready_task_events
from fleet.engine.db_threads import DbThreadPool
from fleet.engine.events import ExecutionResult, TaskReadyEvent
from fleet.executors.inprocess import InProcessExecutor
from fleet.models import WORKFLOW_TERMINAL, WorkflowExecution
from tests.support.loop import run_async


class ReadySink:
    """Collects the events the executor submits (from any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[TaskReadyEvent] = []
        self.seen: list[TaskReadyEvent] = []

    def __call__(self, events: list[TaskReadyEvent]) -> None:
        with self._lock:
            self._events.extend(events)
            self.seen.extend(events)

    def take(self) -> list[TaskReadyEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events


@contextmanager
def running_executor(cache_root, workers: int = 2, **kwargs):
    """A started InProcessExecutor plus the sink its ready events go to."""
    executor = InProcessExecutor(
        workers=workers, claimer="test-server", cache_root=cache_root, **kwargs
    )
    sink = ReadySink()
    ready_queue.register(sink)
    run_async(executor.start())
    try:
        yield executor, sink
    finally:
        ready_queue.register(None)
        run_async(executor.stop())


def _status(execution_id: uuid.UUID) -> str:
    return WorkflowExecution.objects.values_list("status", flat=True).get(pk=execution_id)


def _due(limit: int = 100) -> list[TaskReadyEvent]:
    return [TaskReadyEvent(*row) for row in due_ready_task_events(limit)]


def initial_events(execution_id: uuid.UUID) -> list[TaskReadyEvent]:
    return [e for e in _due() if e.workflow_execution_id == execution_id]


async def drive(
    executor: InProcessExecutor,
    sink: ReadySink,
    execution_id: uuid.UUID,
    timeout_s: float = 30.0,
) -> list[ExecutionResult]:
    """Execute events until the execution is terminal; returns every ExecutionResult."""
    db = DbThreadPool(1, "test-driver")
    results: list[ExecutionResult] = []
    deadline = time.monotonic() + timeout_s
    try:
        events = await db.call(initial_events, execution_id)
        while time.monotonic() < deadline:
            if events:
                unique = list({e.task_execution_id: e for e in events}.values())
                results += await asyncio.gather(*(executor.execute(e) for e in unique))
            if await db.call(_status, execution_id) in WORKFLOW_TERMINAL:
                return results
            events = sink.take()
            if not events:
                await asyncio.sleep(0.02)
                events = [e for e in await db.call(_due) if e.workflow_execution_id == execution_id]
        raise AssertionError(f"execution {execution_id} did not finish within {timeout_s}s")
    finally:
        await asyncio.to_thread(db.close)
