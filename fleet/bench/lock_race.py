"""Placement batches against result batches, several of each at once on their own
connections: the race behind ``fleetbench --lock-order-tenants`` and the lock-order test
(tests/integration/test_fleet_lock_order.py), written once.

Placer threads take Ready task ids in batches and place them with
:func:`~fleet.executors.fleet.delivery.batch_placement.place_tasks` (what found no slot
goes back to the queue); reporter threads each take open packets (``id % reporters``, so
no two report the same one) and report them a success with
:func:`~fleet.executors.fleet.result_intake.apply_results` — the row locks of the
dispatch hot path, without a server or sockets.  Every thread flushes its backend's
statistics before it ends, so ``pg_stat_database.deadlocks`` counts what it lost.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

from django.db import connection

from fleet.bench.database import flush_statistics
from fleet.executors.fleet.delivery.batch_placement import place_tasks
from fleet.executors.fleet.delivery.placement import Placed
from fleet.executors.fleet.result_intake import ResultIn, apply_results
from fleet.models import DeliveryOutbox, TaskExecution

IDLE_WAIT_S = 0.005  # a thread with nothing to do looks again this much later
TICK_S = 0.02  # how often the caller's thread checks for the end


class LockRace:
    """The racing threads' shared state: the Ready ids left to place, and when to stop."""

    def __init__(self, ready: list[uuid.UUID], batch: int, claimer: str) -> None:
        self.lock = threading.Lock()
        self.ready = list(ready)
        self.expected = len(ready)
        self.batch = batch
        self.claimer = claimer
        self.errors: list[BaseException] = []
        self.stop = threading.Event()

    def take(self) -> list[uuid.UUID]:
        with self.lock:
            chunk, self.ready = self.ready[: self.batch], self.ready[self.batch :]
            return chunk

    def give_back(self, ids: list[uuid.UUID]) -> None:
        with self.lock:
            self.ready.extend(ids)

    def place_once(self) -> None:
        """One placement batch; what found no agent goes back for a later one."""
        chunk = self.take()
        if not chunk:
            time.sleep(IDLE_WAIT_S)  # nothing Ready yet: the reporters free slots
            return
        placed = place_tasks(chunk, self.claimer)
        self.give_back([t for t, p in placed.items() if not isinstance(p, Placed)])

    def report_once(self, index: int, reporters: int) -> None:
        """One result batch: a success for each of this reporter's open packets."""
        rows = list(
            DeliveryOutbox.objects.filter(state__in=("pending", "delivered"))
            .extra(where=["id %% %s = %s"], params=[reporters, index])
            .values_list("id", "tenant_id", "agent_id", "task_execution_id", "assignment")[
                : self.batch
            ]
        )
        if not rows:
            time.sleep(IDLE_WAIT_S)
            return
        apply_results(
            [
                (tenant_id, agent_id, ResultIn(outbox_id=row_id, task_execution_id=task,
                                                assignment=assignment, outcome="success", output={}))
                for row_id, tenant_id, agent_id, task, assignment in rows
            ]
        )  # fmt: skip

    def thread(self, body: Callable[[], None]) -> threading.Thread:
        def run() -> None:
            try:
                while not self.stop.is_set():
                    body()
                flush_statistics()
            except BaseException as exc:  # re-raised by run_race
                self.errors.append(exc)
                self.stop.set()
            finally:
                connection.close()

        return threading.Thread(target=run, daemon=True)


def completed_tasks() -> int:
    """Tasks Completed in this database (the race's caller emptied it of any others)."""
    return TaskExecution.objects.filter(status="Completed").count()


def run_race(
    ready: list[uuid.UUID],
    *,
    placers: int,
    reporters: int,
    batch: int,
    timeout_s: float,
    claimer: str = "lock-race",
    every_tick: Callable[[float], None] | None = None,
) -> float:
    """Race ``placers`` placement threads against ``reporters`` result threads until every
    task of ``ready`` has completed (or ``timeout_s`` passed); the wall seconds it took.
    ``every_tick(elapsed_s)`` runs on the caller's thread between its checks (the bench's
    heartbeats).  The first error of any thread is raised once all have stopped."""
    race = LockRace(ready, batch, claimer)
    threads = [race.thread(race.place_once) for _ in range(placers)]
    threads += [race.thread(lambda i=i: race.report_once(i, reporters)) for i in range(reporters)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    while not race.stop.is_set():
        elapsed = time.perf_counter() - started
        if completed_tasks() >= race.expected or elapsed > timeout_s:
            break
        if every_tick is not None:
            every_tick(elapsed)
        time.sleep(TICK_S)
    wall = time.perf_counter() - started
    race.stop.set()
    for thread in threads:
        thread.join()
    if race.errors:
        raise race.errors[0]
    return wall
