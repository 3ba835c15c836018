"""Placing many Ready tasks on the fleet in ONE transaction (the fleet executor's hot path).

:func:`fleet.executors.fleet.delivery.placement.place_task` claims, prepares and reserves one
task per transaction: four statements, each planned and committed for one task,
which was most of the database's work per task.  :func:`place_tasks` does the
same for a batch:

* one statement locking every task of the batch (still Ready), which also reads their
  contexts and their executions' packages (:func:`~fleet.engine.claims.lock_work`); the
  claims are written later, each with the agent it names;
* per claim the same :func:`~fleet.executors.fleet.delivery.placement.prepare` (the shared
  context builder, the packet, the oversize and selector checks);
* *plain* tasks (no selector, no group or affinity binding — the common case) that
  can run on the same target triples (every python package: any) are reserved and
  enqueued together in one statement, whatever their tenants and packages, each
  tenant's on its own agents
  (:func:`~fleet.executors.fleet.delivery.placement.reserve_and_enqueue`): a batch
  spanning ten tenants costs what a batch of one does; every other task goes through
  :func:`~fleet.executors.fleet.delivery.placement.place_prepared` as if alone;
  the reservation statement writes each placed task's claim with its agent (one row
  version per placement) and leaves the tasks it found no slot for Ready and unwritten;
  their wait reason is written once its result is read (only where it changes);
* one commit.  The transaction is pipelined (:mod:`fleet.platform.pipelined_tx`): BEGIN
  goes out with the claim, and when one reservation statement is all there is (one
  group: the idle pickup, most batches) it goes out with the COMMIT and its result is
  read after it — two round trips for the whole placement.

A batch that reserves in more than one statement (packages of different target
triples, or tasks with selectors) first takes every lock it may wait for, in one statement per
kind and in the one global order (:func:`~fleet.executors.fleet.delivery.placement.lock_up_front`:
the binding keys, then the agent rows in id order), and reserves without waiting
after that: it waits for agent rows once, in id order, like every other writer of
agent rows (result batches, heartbeats, breakers), so it cannot deadlock with them
however many tenants they span (docs/fleet.md, "Lock order").  A batch of one
group needs no extra statement: its one reservation statement is that ordered lock.

Either the whole batch commits or none of it; a batch that fails (the database
going away, say) is placed again one task at a time, each in a transaction of its
own — the outcome per task is exactly what ``place_task`` would have given.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Callable

from django.db import DatabaseError

from agents.protocol import hop_trace
from fleet.engine.claims import ClaimedWork, lock_work, note_wait_reason
from fleet.executors.fleet.delivery import placement
from fleet.executors.fleet.delivery.placement import (
    NoAgent,
    NotClaimed,
    Placed,
    Prepared,
    Unroutable,
)
from fleet.executors.fleet.routing.candidates import no_capacity_reason
from fleet.executors.fleet.routing.metrics import (
    BACKPRESSURE,
    SELECTION_FAILURE,
    SELECTION_SUCCESS,
    observe_selections,
)
from fleet.executors.fleet.routing.selectors import UNCONSTRAINED
from fleet.platform.pipelined_tx import pipelined_atomic

log = logging.getLogger(__name__)

Placement = Placed | NoAgent | NotClaimed


def _place_plain(
    group: list[Prepared], prelocked: bool = False
) -> Callable[[], dict[uuid.UUID, Placement]]:
    """Send the group's one reservation statement (the caller's transaction); the returned
    call reads its result — before the commit, or after it when it is the transaction's
    last statement, so that it travels with the COMMIT.  The tasks without a slot were
    released by the statement itself; the call writes why they wait."""
    # Timed like selection.select times one task: choosing and reserving (and enqueueing,
    # which is the same statement), one observation per task of the group.
    started = time.perf_counter()
    reservation = placement.reserve_and_enqueue(group, prelocked)

    def finish() -> dict[uuid.UUID, Placement]:
        try:
            placed = reservation.placed()
        finally:
            observe_selections(time.perf_counter() - started, len(group))
        return _results(group, placed)

    return finish


def _results(group: list[Prepared], placed: dict[uuid.UUID, Placed]) -> dict[uuid.UUID, Placement]:
    results: dict[uuid.UUID, Placement] = {}
    waiting: dict[int, list[Prepared]] = defaultdict(list)  # per tenant: the group spans tenants
    for prepared in group:
        agent = placed.get(prepared.claim.task_execution_id)
        if agent is not None:
            results[prepared.claim.task_execution_id] = agent
        else:  # no slot left (or the free agents were being reserved by someone else)
            waiting[prepared.claim.tenant_id].append(prepared)
    reasons: dict[int, str] = {}
    for tenant_id, released in waiting.items():
        reason = reasons[tenant_id] = _explain(tenant_id, released)
        for prepared in released:
            results[prepared.claim.task_execution_id] = NoAgent(tenant_id, reason)
    if placed:
        SELECTION_SUCCESS.labels(step=UNCONSTRAINED.step).inc(len(placed))
    if len(placed) < len(group):
        SELECTION_FAILURE.labels(reason="no_free_agent").inc(len(group) - len(placed))
        if any("at capacity" in reason for reason in reasons.values()):
            BACKPRESSURE.labels(reason="agents_full").inc()
    return results


def _explain(tenant_id: int, released: list[Prepared]) -> str:
    """Why these released tasks of one tenant wait, written on their rows.  After the commit
    the batch is placed whatever happens here: a database error leaves the placeholder."""
    try:
        reason = no_capacity_reason(tenant_id, released[0].triples)
        # Never claimed: the rows still carry the assignment before the deferred claim's.
        note_wait_reason(
            [(p.claim.task_execution_id, p.claim.assignment - 1) for p in released], reason
        )
    except DatabaseError as exc:
        log.warning("could not say why %d task(s) wait: %s", len(released), exc)
        return placement.NO_SLOT
    return reason


def _place_batch(task_execution_ids: list[uuid.UUID], claimer: str) -> dict[uuid.UUID, Placement]:
    results: dict[uuid.UUID, Placement] = {}
    # Plain tasks by the target triples they can run on (None: any), whatever the tenant.
    plain: dict[frozenset[str] | None, list[Prepared]] = defaultdict(list)
    others: list[Prepared] = []
    last: Callable[[], dict[uuid.UUID, Placement]] | None = None
    hop_trace.mark_many("placing", task_execution_ids)
    # BEGIN goes out with the claim, COMMIT with the last statement (pipeline mode).
    with pipelined_atomic() as tx:
        # One statement: the tasks locked, with their contexts and their executions'
        # packages; it goes out with the BEGIN, and the sync that reads it leaves pipeline
        # mode.  Their claims are deferred: each is written with the agent it gets (one
        # row version), or before anything else writes the task (placement.write_deferred).
        claimed = lock_work(task_execution_ids, claimer, before_read=tx.sync)
        hop_trace.mark_many("claimed", task_execution_ids)
        claimed.sort(key=_claim_key)
        for work in claimed:
            prepared = placement.prepare(work)
            if isinstance(prepared, Unroutable):
                results[work.claim.task_execution_id] = prepared
            elif prepared.request.plain:
                plain[prepared.triples].append(prepared)
            else:
                others.append(prepared)
        # More than one reserving statement: lock first, then reserve without waiting.
        prelocked = len(plain) + len(others) > 1
        if prelocked:
            placement.lock_up_front([p for group in plain.values() for p in group] + others)
            for group in plain.values():
                results.update(_place_plain(group, prelocked)())
            for prepared in others:
                results[prepared.claim.task_execution_id] = placement.place_prepared(
                    prepared, wait=False
                )
        elif plain:  # the common case: one statement, sent with the COMMIT, read after it
            tx.pipeline_tail()
            last = _place_plain(next(iter(plain.values())))
        elif others:
            results[others[0].claim.task_execution_id] = placement.place_prepared(others[0])
    if last is not None:
        results.update(last())
    hop_trace.mark_many("committed", task_execution_ids)
    return results


def _claim_key(work: ClaimedWork) -> str:
    return str(work.claim.task_execution_id)


def place_tasks(task_execution_ids: list[uuid.UUID], claimer: str) -> dict[uuid.UUID, Placement]:
    """Claim and place these tasks (see the module docstring): task id → Placed, NoAgent
    (claim released, the reason written), Unroutable (failed for good) or NotClaimed."""
    if not task_execution_ids:
        return {}
    try:
        results = _place_batch(task_execution_ids, claimer)
    except DatabaseError:
        if len(task_execution_ids) == 1:
            raise
        log.warning(
            "placing a batch of %d tasks failed; placing them one by one",
            len(task_execution_ids),
            exc_info=True,
        )
        results = {}
        for task_execution_id in task_execution_ids:
            try:
                results[task_execution_id] = placement.place_task(task_execution_id, claimer)
            except DatabaseError:
                log.exception("placing task %s failed", task_execution_id)
                results[task_execution_id] = NotClaimed("placement failed: the task stays Ready")
    return {
        task_execution_id: results.get(task_execution_id, NotClaimed())
        for task_execution_id in task_execution_ids
    }
