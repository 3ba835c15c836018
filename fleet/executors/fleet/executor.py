"""The ``fleet`` executor: every task runs on a DB-less agent (docs/fleet.md).

``execute`` places the task in one transaction (:mod:`fleet.executors.fleet.delivery.placement`:
claim, shared context builder, atomic slot reservation, outbox row), then
waits at the rendezvous keyed by task_execution_id until some process
applies the outcome (the result endpoint wakes it directly or by NOTIFY) —
re-reading the database every few seconds, so a lost wake-up or a passed
result deadline never strands it.  No agent with room: the claim is released
with the reason and the result is REQUEUED (not an attempt).

``start`` runs this process's delivery machinery on the event loop: the
LISTEN connection, the outbox relay and the capacity probe behind
``has_capacity``.  ``periodic_jobs`` are the sweeps: liveness + reclaim,
redelivery, pruning, depth samples and wait reasons.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid

import psycopg
from django.db import connection

from agents.protocol import hop_trace
from fleet.engine import ready_queue
from fleet.engine.batcher import Batcher
from fleet.engine.events import ExecutionResult, ExecutionStatus, ExecutorMetrics, TaskReadyEvent
from fleet.engine.executor import PeriodicJob, TaskExecutor
from fleet.executors.fleet import result_batches, socket_writes
from fleet.executors.fleet.capacity_estimate import CapacityEstimate
from fleet.executors.fleet.delivery import db as delivery_db
from fleet.executors.fleet.delivery import local_sockets, outbox_ack
from fleet.executors.fleet.delivery.batch_placement import place_tasks
from fleet.executors.fleet.delivery.depth import SAMPLE_INTERVAL_S, sample_outbox_depth
from fleet.executors.fleet.delivery.handover import stop_taking_sockets
from fleet.executors.fleet.delivery.listener import NotificationListener
from fleet.executors.fleet.delivery.one_trip import LoopPlacer
from fleet.executors.fleet.delivery.pg import connect_async
from fleet.executors.fleet.delivery.placement import (
    Delivered,
    NoAgent,
    NotClaimed,
    Placed,
    place_task,
    run_status,
)
from fleet.executors.fleet.delivery.pruning import prune_acked, prune_depth_samples
from fleet.executors.fleet.delivery.redelivery import redeliver_unreceived
from fleet.executors.fleet.delivery.relay import Relay
from fleet.executors.fleet.delivery.rendezvous import CHANNEL as OUTCOME_CHANNEL
from fleet.executors.fleet.delivery.rendezvous import rendezvous
from fleet.executors.fleet.delivery.wait_reasons import (
    WAIT_REASON_INTERVAL_S,
    explain_waiting_tasks,
)
from fleet.executors.fleet.delivery.waiting import wait_event, wait_or_none
from fleet.executors.fleet.lifecycle import sweep_dead_agents
from fleet.executors.fleet.state import breaker, ledger
from fleet.platform.config import Config

log = logging.getLogger(__name__)

EXECUTOR_KEY = "fleet"
OUTCOME_RECHECK_S = 5.0  # a waiter re-reads its task this often (lost wake-up, deadline)
CAPACITY_PROBE_S = 0.1  # how stale has_capacity's view of free agent slots may get
PRUNE_INTERVAL_S = 60.0
PLACE_BATCH = 128  # most tasks placed in one transaction
REOFFER_AFTER_S = 0.05  # a task placement found no slot for is offered again this much later
# … and, when its tenant's agents were all busy (not absent), once more this much later.
REOFFER_BUSY_AFTER_S = 0.25
REOFFERED_MAX = 10_000  # tasks remembered as re-offered (a bound: see _reoffer_once)
BUSY = "at capacity"  # in the wait reason of a tenant whose live agents are all busy

# Free slots, and slots in all (the executor's capacity on /metrics), on the agents that
# can take work now: one probe answers both.  An agent whose circuit breaker is open offers
# no free slot, a half-open one its probe's only.
_FREE_SLOTS = f"""
SELECT coalesce(sum({breaker.slot_cap("a", ledger.free_slots("a"))})
                FILTER (WHERE {ledger.has_free_slot("a")} AND {breaker.admits("a")}), 0),
       coalesce(sum(a.max_concurrency), 0)
FROM {ledger.AGENTS} a
WHERE a.state = 'live' AND a.connected_to <> ''
  AND a.last_heartbeat > now() - make_interval(secs => %s)
"""


class FleetExecutor(TaskExecutor):
    key = EXECUTOR_KEY
    # Each dispatch waits for a remote outcome: many may be in flight per process.
    dispatch_concurrency = 1024

    def __init__(self, claimer: str, config: Config) -> None:
        self.claimer = claimer
        self.config = config
        # Its side of every outcome (ack the packet, free the slot) is the engine's
        # settle hook; FleetConfig.ready registered it already in every process.
        outbox_ack.register()
        local_sockets.set_server_id(claimer)
        self.relay = Relay()
        self.capacity = CapacityEstimate()
        self.listener: NotificationListener | None = None
        self._probe_task: asyncio.Task | None = None
        self._placer: Batcher[uuid.UUID, Placed | NoAgent | NotClaimed] | None = None
        self._loop_placer: LoopPlacer | None = None
        self._warming: asyncio.Task | None = None
        self._tenant_of: dict[uuid.UUID, int] = {}  # tasks being placed → their tenant
        self._probe_wake = asyncio.Event()
        self._started_at = time.monotonic()
        self._database_seen_at = self._started_at  # by the liveness sweep
        self._grace_until = 0.0
        self._active = 0
        self._stats = {"completed": 0, "failed": 0, "requeued": 0, "dispatched": 0}
        self._reoffered: dict[uuid.UUID, int] = {}  # requeued: offered again how often in a row
        self._run_seconds = 0.0  # placement to outcome, summed over the finished runs

    # -- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        self._started_at = self._database_seen_at = time.monotonic()
        self._probe_wake = asyncio.Event()
        self.listener = NotificationListener(
            {ledger.OUTBOX_CHANNEL: self.relay.on_notify, OUTCOME_CHANNEL: rendezvous.on_notify},
            on_reconnect=self._after_listener_reconnect,
        )
        self.listener.start()
        self.relay.start()
        # A lone placement (an idle pickup) skips the batching task (fleet/engine/batcher.py)
        # and is made on this loop in one statement when it can be
        # (fleet/executors/fleet/delivery/one_trip.py), else on a delivery thread.
        self._loop_placer = LoopPlacer(self.claimer)
        self._warming = asyncio.create_task(self._loop_placer.warm(), name="fleet-placer-warm")
        self._placer = Batcher(
            self._place_batch, PLACE_BATCH, "fleet-placement", delivery_db.call,
            lone_at_once=True, alone=self._place_alone,
        )  # fmt: skip
        self._probe_task = asyncio.create_task(self._probe_capacity(), name="fleet-capacity")
        await wait_event(self.listener.listening, 5.0)
        log.info("fleet executor started (server %s)", self.claimer)

    def hand_over(self) -> None:
        """Take no more agent sockets: `serve` sends the agents to other replicas."""
        stop_taking_sockets()

    async def stop(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._probe_task
            self._probe_task = None
        if self._placer is not None:
            await self._placer.close()
            self._placer = None
        if self._warming is not None:
            self._warming.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._warming
            self._warming = None
        if self._loop_placer is not None:
            await self._loop_placer.close()
            self._loop_placer = None
        await self.relay.stop()
        if self.listener is not None:
            await self.listener.stop()
        await socket_writes.close_writer()
        await result_batches.close_batches()
        await asyncio.get_running_loop().run_in_executor(None, delivery_db.close)

    def _after_listener_reconnect(self) -> None:
        self.relay.kick()
        rendezvous.wake_all_to_recheck()

    async def _probe_capacity(self) -> None:
        conn: psycopg.AsyncConnection | None = None
        try:
            while True:
                try:
                    if conn is None or conn.closed:
                        conn = await connect_async("cloacina-capacity")
                    await self._probe_once(conn)
                except (psycopg.Error, OSError) as exc:
                    log.debug("capacity probe failed: %s", exc)
                    self.capacity.probe_failed()
                    if conn is not None:
                        with contextlib.suppress(Exception):
                            await conn.close()
                    conn = None
                self._probe_wake.clear()
                await wait_event(self._probe_wake, CAPACITY_PROBE_S)
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()

    async def _probe_once(self, conn: psycopg.AsyncConnection) -> None:
        was_available = self.capacity.available()
        self.capacity.probe_started(rendezvous.mark())
        cursor = await conn.execute(_FREE_SLOTS, [self.config.liveness_window_s])
        free, total = await cursor.fetchone()
        self.capacity.probe_read(int(free), int(total))
        if self.capacity.available() > max(was_available, 0):
            self.capacity_freed()  # new agents, or slots freed by another process

    # -- the TaskExecutor interface -------------------------------------------------
    def has_capacity(self) -> bool:
        return self.capacity.available() > 0

    def metrics(self) -> ExecutorMetrics:
        """This process's runs (active: placed and awaiting their outcome; executed, failed,
        their mean time from placement to outcome) and the fleet's capacity: the slots of
        the live, connected agents at the last capacity probe (no query per scrape)."""
        executed = self._stats["completed"] + self._stats["failed"]
        return ExecutorMetrics(
            active_tasks=self._active,
            max_concurrent=self.capacity.total,
            total_executed=executed,
            total_failed=self._stats["failed"],
            avg_duration_ms=self._run_seconds / executed * 1000.0 if executed else 0.0,
            extra={
                "requeued": self._stats["requeued"],
                "dispatched": self._stats["dispatched"],
                "pushed": self.relay.pushed,
                "local_agents": len(local_sockets.snapshot()),
                "waiting": rendezvous.waiting(),
            },
        )

    async def execute(self, event: TaskReadyEvent) -> ExecutionResult:
        task_execution_id = event.task_execution_id
        started = time.monotonic()
        # The waiter exists before the packet can reach an agent (no lost early result).
        future = rendezvous.register(task_execution_id)
        self.capacity.claiming += 1
        self._tenant_of[task_execution_id] = event.tenant_id
        try:
            placement = await self._place(task_execution_id)
        except BaseException:
            rendezvous.unregister(task_execution_id, future)
            raise
        finally:
            self.capacity.claiming -= 1
            self._tenant_of.pop(task_execution_id, None)
        hop_trace.mark("placed_on_loop", task_execution_id)
        if isinstance(placement, NotClaimed | NoAgent):
            rendezvous.unregister(task_execution_id, future)
            if isinstance(placement, NotClaimed):
                self._reoffered.pop(task_execution_id, None)
                # SUPERSEDED, or FAILED for a task no agent could ever run (Unroutable).
                return ExecutionResult(task_execution_id, placement.status, placement.reason)
            self._stats["requeued"] += 1
            # What we believed free was not: look again now rather than at the next probe.
            self.capacity.probed = 0 if self.capacity.probed is not None else None
            self._probe_wake.set()
            self._reoffer(event, busy=BUSY in placement.reason)
            log.debug("task %s waits: %s", task_execution_id, placement.reason)
            return ExecutionResult(task_execution_id, ExecutionStatus.REQUEUED, placement.reason)
        self._reoffered.pop(task_execution_id, None)
        self._stats["dispatched"] += 1
        self.capacity.delta -= 1
        self._active += 1
        rendezvous.set_assignment(task_execution_id, placement.assignment)
        posted = 0
        try:
            if isinstance(placement, Delivered):
                await self._push(placement)
            else:
                # Committed as pending (selectors, bindings, a lone placement): if the
                # agent's socket is here, the relay takes it now, not after the NOTIFY.
                self.relay.wake_for(placement.agent_id)
            status, posted = await self._await_outcome(
                task_execution_id, placement.assignment, future
            )
        finally:
            self._active -= 1
            if self.capacity.give_back(posted):
                self.capacity_freed()
        duration_s = time.monotonic() - started
        if status == ExecutionStatus.COMPLETED:
            self._stats["completed"] += 1
        elif status in (ExecutionStatus.FAILED, ExecutionStatus.RETRY):
            self._stats["failed"] += 1  # a failed attempt, retried or not
        if status in (ExecutionStatus.COMPLETED, ExecutionStatus.FAILED, ExecutionStatus.RETRY):
            self._run_seconds += duration_s
        return ExecutionResult(task_execution_id, status, duration_s=duration_s)

    def _reoffer(self, event: TaskReadyEvent, busy: bool) -> None:
        """Offer a task its placement found no free slot for again, shortly, once in a row —
        twice when its tenant's agents were all busy (``busy``) rather than absent.

        The capacity estimate is a hint: under load another placement often took the slot
        this one was counted on, and one is free again a moment later (the dispatch loop
        waits for it: the estimate was just reset).  Left to the loop's tick (every
        ``CLOACINA_SCHEDULER_POLL_S``, 1 s by default, and skipped while a deep queue
        drains) such a task waited up to a second or more: in fleetbench's drain a dozen of
        them made a phase of two seconds last three.  A second miss in a row came from
        that tick still in round i17-relay (a drain's last tasks started at the tick, a
        second after the others); when the agents are there but busy, a slot frees
        within a run's time, so the task is offered once more after
        ``REOFFER_BUSY_AFTER_S``.  A task no agent can take (none live in its tenant, none
        can load it, breakers open) is left to the tick after its first re-offer, so it
        is claimed and released twice per tick, not every few milliseconds; a busy tenant's
        task at most three times."""
        task_execution_id = event.task_execution_id
        offered = self._reoffered.pop(task_execution_id, 0)
        delays = (REOFFER_AFTER_S, REOFFER_BUSY_AFTER_S) if busy else (REOFFER_AFTER_S,)
        if offered >= len(delays):
            return  # the tick takes it from here
        if len(self._reoffered) >= REOFFERED_MAX:  # tasks cancelled while they waited
            self._reoffered.clear()
        self._reoffered[task_execution_id] = offered + 1
        asyncio.get_running_loop().call_later(delays[offered], ready_queue.submit, [event])

    async def _place(self, task_execution_id: uuid.UUID) -> Placed | NoAgent | NotClaimed:
        if self._placer is None:  # not started (tests driving execute directly)
            return await delivery_db.call(place_task, task_execution_id, self.claimer)
        # With every task that turns up while the previous batch is written: one
        # transaction for them all (fleet/executors/fleet/delivery/batch_placement.py).
        return await self._placer.submit(task_execution_id)

    async def _place_alone(self, task_execution_id: uuid.UUID) -> Placed | None:
        """A lone placement in one statement on this loop; None: the usual path places it."""
        tenant_id = self._tenant_of.get(task_execution_id, 0)
        if self._loop_placer is None or not tenant_id:
            return None
        return await self._loop_placer.place(task_execution_id, tenant_id)

    async def _push(self, placed: Delivered) -> None:
        try:
            await self.relay.push_delivered(
                placed.agent_id, placed.outbox_id, placed.packet, placed.waited_s
            )
        except (psycopg.Error, OSError) as exc:
            # The row stays delivered and unconfirmed: redelivery pushes it again.
            log.warning("could not push or return packet %s: %s", placed.outbox_id, exc)

    def _place_batch(
        self, task_execution_ids: list[uuid.UUID]
    ) -> list[Placed | NoAgent | NotClaimed]:
        placed = place_tasks(task_execution_ids, self.claimer)
        return [placed[task_execution_id] for task_execution_id in task_execution_ids]

    async def _await_outcome(
        self, task_execution_id: uuid.UUID, assignment: int, future: asyncio.Future
    ) -> tuple[ExecutionStatus, int]:
        """The run's status and its outcome's wake-up number (0: read from the database)."""
        try:
            while True:
                # Jitter spreads the re-checks of many long-running waiters.
                timeout = OUTCOME_RECHECK_S * random.uniform(0.8, 1.2)
                outcome = await wait_or_none(future, timeout)
                if outcome is not None and outcome.assignment == assignment:
                    return outcome.status, outcome.posted
                status = await delivery_db.call(run_status, task_execution_id, assignment)
                if status is not None:
                    return status, 0
                if future.done():  # woken to re-check: wait on a fresh future
                    rendezvous.unregister(task_execution_id, future)
                    future = rendezvous.register(task_execution_id, assignment)
        finally:
            rendezvous.unregister(task_execution_id, future)

    def periodic_jobs(self) -> list[PeriodicJob]:
        config = self.config
        return [
            PeriodicJob(
                "fleet_liveness_sweep",
                self._liveness_sweep,
                max(0.05, config.heartbeat_interval_s / 2),
                leader_only=True,
            ),
            PeriodicJob(
                "fleet_redelivery",
                lambda: redeliver_unreceived(config.outbox_redeliver_s, config.outbox_max_pushes),
                max(0.1, config.outbox_redeliver_s / 2),
                leader_only=True,
            ),
            PeriodicJob(
                "fleet_prune_outbox",
                lambda: (prune_acked(config.outbox_retention_s), prune_depth_samples()),
                min(PRUNE_INTERVAL_S, max(1.0, config.outbox_retention_s / 2)),
                leader_only=True,
            ),
            PeriodicJob(
                "fleet_outbox_depth", sample_outbox_depth, SAMPLE_INTERVAL_S, leader_only=True
            ),
            PeriodicJob(
                "fleet_wait_reasons",
                explain_waiting_tasks,
                WAIT_REASON_INTERVAL_S,
                leader_only=True,
            ),
        ]

    def _liveness_sweep(self) -> None:
        # Agents' beats cannot land while no server is up, or while this one cannot reach
        # the database (or was stalled): after a start or any such gap, agents get one
        # liveness window to reach it again before anyone is evicted.  Without this, a
        # database restart longer than the window evicted every live agent.
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")  # raises while the database is away: not seen
        now, window = time.monotonic(), self.config.liveness_window_s
        if now - self._database_seen_at > window:
            self._grace_until = now + window
        self._database_seen_at = now
        if now < max(self._grace_until, self._started_at + window):
            return
        sweep_dead_agents()
