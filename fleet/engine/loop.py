"""The dispatch loop: Ready tasks → Dispatcher, on the server's asyncio event loop.

Events arrive two ways: the fast path (:mod:`fleet.engine.ready_queue`, fed by
the API, the result handler and recovery, from any thread) and the periodic
tick, which scans the database for due Ready tasks, so a lost event costs
latency, never work.  The database stays the truth: an event is only a hint
to try ``claim_task``; a task offered twice (or by two servers) is claimed once.

Dispatch workers are asyncio tasks awaiting ``dispatcher.dispatch(event)``.
When the executor is full a worker holds its event and waits for a run to
finish (or a short poll) instead of dropping it, so a burst is drained at the
executor's pace with no wait for the next tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from django.db import close_old_connections

from agents.protocol import hop_trace
from fleet.engine import loop_inbox, ready_queue
from fleet.engine.claims import due_ready_task_events
from fleet.engine.dispatcher import Dispatcher
from fleet.engine.events import ExecutionStatus, NoCapacity, TaskReadyEvent
from fleet.engine.fair_queue import FairQueue

log = logging.getLogger(__name__)

CAPACITY_POLL_S = 0.05  # re-check capacity this often even when no run finished (new agents, …)
TICK_LIMIT = 2000  # most events the tick keeps queued at once
MIN_WORKERS = 4
FLEET_WORKERS = 512  # the fleet executor awaits remote results: many runs in flight per process


def dispatch_concurrency(dispatcher: Dispatcher) -> int:
    """How many dispatches may be in flight: the executor's own hint, else 4 × its capacity."""
    executor = dispatcher.executor
    hint = getattr(executor, "dispatch_concurrency", None)
    if hint:
        return int(hint)
    if executor.key == "fleet":
        return FLEET_WORKERS
    return max(MIN_WORKERS, 4 * int(executor.metrics().max_concurrent or 1))


class EngineLoop:
    def __init__(
        self,
        dispatcher: Dispatcher,
        poll_s: float,
        concurrency: int | None = None,
        tick_limit: int = TICK_LIMIT,
    ) -> None:
        self._dispatcher = dispatcher
        self._poll_s = poll_s
        self._concurrency = concurrency or dispatch_concurrency(dispatcher)
        self._tick_limit = tick_limit
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue = FairQueue()
        # Dedupe by task id: an id is either queued (waiting for a worker) or running
        # (being dispatched).  A new event for a running id is kept in _again and
        # queued when that dispatch ends (a retry with no backoff, a refusal).
        self._queued: set[uuid.UUID] = set()
        self._running: set[uuid.UUID] = set()
        self._again: dict[uuid.UUID, TaskReadyEvent] = {}
        self._capacity_freed = asyncio.Event()
        self._capacity_gate = asyncio.Lock()
        self._workers: list[asyncio.Task] = []
        self._ticker: asyncio.Task | None = None
        self._accepting = False
        # The tick's database work runs on one thread of its own: it never waits
        # behind request handlers, and its connection is reused between ticks.
        self._db = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-tick")
        self.stats = {"dispatched": 0, "completed": 0, "failed": 0, "no_capacity": 0, "errors": 0}

    # -- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._accepting = True
        ready_queue.register(self.submit_threadsafe)
        # Woken the moment the executor frees a slot; CAPACITY_POLL_S is only the safety net.
        self._dispatcher.executor.add_capacity_listener(self._capacity_freed.set)
        self._workers = [
            asyncio.create_task(self._worker(), name=f"dispatch-{i}")
            for i in range(self._concurrency)
        ]
        self._ticker = asyncio.create_task(self._tick_forever(), name="engine-tick")
        log.info(
            "dispatch loop started: %d workers, tick every %.2fs",
            self._concurrency,
            self._poll_s,
        )

    def stop_accepting(self) -> None:
        """Take no new events (fast path or tick); dispatches already running carry on."""
        self._accepting = False
        ready_queue.register(None)
        if self._ticker is not None:
            self._ticker.cancel()

    async def stop(self) -> None:
        """Stop everything; queued events are dropped (their tasks stay Ready in the database)."""
        self.stop_accepting()
        tasks = [*self._workers, *([self._ticker] if self._ticker else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._workers = []
        self._db.shutdown(wait=False, cancel_futures=True)

    @property
    def concurrency(self) -> int:
        return self._concurrency

    def pending(self) -> int:
        """Events queued or being dispatched."""
        return len(self._queued) + len(self._running)

    # -- intake --------------------------------------------------------------------
    def submit_threadsafe(self, events: list[TaskReadyEvent]) -> None:
        """The ready_queue sink: callable from any thread."""
        loop = self._loop
        if loop is None or not self._accepting:
            return
        # Through the loop's inbox: a result batch's ready events, its waiters' outcomes
        # and its answer reach the loop in one wake-up (fleet/engine/loop_inbox.py).  A
        # closing loop drops them: the tick of a live server finds the rows.
        loop_inbox.inbox(loop).post(self.offer, events)

    def offer(self, events: Iterable[TaskReadyEvent]) -> int:
        """Queue events not already queued or running (call on the event loop); return how many."""
        if not self._accepting:
            return 0
        added = 0
        for event in events:
            task_execution_id = event.task_execution_id
            if task_execution_id in self._queued:
                continue
            if task_execution_id in self._running:
                self._again[task_execution_id] = event
                continue
            self._queued.add(task_execution_id)
            self._queue.put_nowait(event)
            hop_trace.mark("loop_queued", task_execution_id)
            added += 1
        return added

    # -- dispatch ------------------------------------------------------------------
    async def _wait_for_capacity(self) -> None:
        if self._dispatcher.has_capacity():
            return
        # One worker at a time waits for a slot; the others queue on the lock (FIFO).
        # Without it every idle worker (the fleet has ~1000) wakes on every freed slot
        # and every poll, and the wake-ups alone saturate the event loop.
        async with self._capacity_gate:
            while not self._dispatcher.has_capacity():
                self._capacity_freed.clear()
                # asyncio.timeout, not wait_for: under a full fleet this runs once per
                # finished run, and wait_for (Python 3.11) wraps the wait in a task of its
                # own each time.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(CAPACITY_POLL_S):
                        await self._capacity_freed.wait()

    async def _worker(self) -> None:
        while True:
            event = await self._queue.get()
            task_execution_id = event.task_execution_id
            await self._wait_for_capacity()
            hop_trace.mark("dispatching", task_execution_id)
            self._queued.discard(task_execution_id)
            self._running.add(task_execution_id)
            requeue = False
            try:
                result = await self._dispatcher.dispatch(event)
            except NoCapacity:
                self.stats["no_capacity"] += 1
                requeue = True
            except asyncio.CancelledError:
                raise
            except Exception:
                # The task keeps its database state: Ready ones are offered again by
                # the tick, claimed ones are fenced and recovered by the sweeps.
                self.stats["errors"] += 1
                log.exception("dispatching task %s (%s) failed", task_execution_id, event.task_name)
            else:
                self.stats["dispatched"] += 1
                if result.status == ExecutionStatus.COMPLETED:
                    self.stats["completed"] += 1
                elif result.status == ExecutionStatus.FAILED:
                    self.stats["failed"] += 1
            finally:
                self._running.discard(task_execution_id)
                self._capacity_freed.set()
            again = self._again.pop(task_execution_id, None)
            if requeue:
                await asyncio.sleep(CAPACITY_POLL_S)
                self.offer([again or event])
            elif again is not None:
                self.offer([again])

    # -- tick ------------------------------------------------------------------------
    async def _tick_forever(self) -> None:
        while self._accepting:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("scheduler tick failed")
            await asyncio.sleep(self._poll_s)

    async def tick(self) -> int:
        """Offer due Ready tasks from the database; return how many were new to the queue."""
        room = self._tick_limit - len(self._queued)
        if len(self._queued) >= self._tick_limit // 2:
            # Plenty queued: the next scan can wait until the queue has drained half-way.
            # (Each scan sorts every due Ready row and returns the queued ones again: under
            # a deep backlog that was a sizeable share of the database's work.)
            return 0
        # Already-queued rows come back too (they are still Ready): ask for enough to see past them.
        limit = room + len(self._queued) + len(self._running)
        loop = asyncio.get_running_loop()
        rows = await loop.run_in_executor(self._db, _due_rows, limit)
        return self.offer(TaskReadyEvent(*row) for row in rows)


def _due_rows(limit: int) -> list[tuple]:
    close_old_connections()
    try:
        return due_ready_task_events(limit)
    finally:
        close_old_connections()
