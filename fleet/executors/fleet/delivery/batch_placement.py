"""Placing many Ready tasks on the fleet in ONE transaction (the fleet executor's hot path).

:func:`fleet.executors.fleet.delivery.placement.place_task` claims, prepares and reserves one
task per transaction: four statements, each planned and committed for one task,
which was most of the database's work per task.  :func:`place_tasks` does the
same for a batch:

* one claim statement for every task of the batch, which also reads their contexts and
  their executions' packages (:func:`~fleet.engine.claims.claim_work`);
* per claim the same :func:`~fleet.executors.fleet.delivery.placement.prepare` (the shared
  context builder, the packet, the oversize and selector checks);
* *plain* tasks (no selector, no group or affinity binding — the common case) that
  can run on the same target triples (every python package: any) are reserved and
  enqueued together in one statement, whatever their tenants and packages, each
  tenant's on its own agents
  (:func:`~fleet.executors.fleet.delivery.placement.reserve_and_enqueue`): a batch
  spanning ten tenants costs what a batch of one does; every other task goes through
  :func:`~fleet.executors.fleet.delivery.placement.place_prepared` as if alone;
* one commit.

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

from django.db import DatabaseError

from fleet.engine.claims import ClaimedWork, claim_work, release_claim
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


def _place_plain(group: list[Prepared], prelocked: bool = False) -> dict[uuid.UUID, Placement]:
    # Timed like selection.select times one task: choosing and reserving (and enqueueing,
    # which is the same statement), one observation per task of the group.
    started = time.perf_counter()
    try:
        placed = placement.reserve_and_enqueue(group, prelocked)
    finally:
        observe_selections(time.perf_counter() - started, len(group))
    results: dict[uuid.UUID, Placement] = {}
    reasons: dict[int, str] = {}  # per tenant: the group spans tenants
    for prepared in group:
        claim = prepared.claim
        agent = placed.get(claim.task_execution_id)
        if agent is not None:
            results[claim.task_execution_id] = agent
            continue
        # No slot left (or the free agents are being reserved by someone else right now).
        reason = reasons.get(claim.tenant_id)
        if reason is None:
            reason = reasons[claim.tenant_id] = no_capacity_reason(
                claim.tenant_id, prepared.triples
            )
        release_claim(claim.task_execution_id, claim.assignment, reason)
        results[claim.task_execution_id] = NoAgent(claim.tenant_id, reason)
    if placed:
        SELECTION_SUCCESS.labels(step=UNCONSTRAINED.step).inc(len(placed))
    if len(placed) < len(group):
        SELECTION_FAILURE.labels(reason="no_free_agent").inc(len(group) - len(placed))
        if any("at capacity" in reason for reason in reasons.values()):
            BACKPRESSURE.labels(reason="agents_full").inc()
    return results


def _place_batch(task_execution_ids: list[uuid.UUID], claimer: str) -> dict[uuid.UUID, Placement]:
    results: dict[uuid.UUID, Placement] = {}
    # Plain tasks by the target triples they can run on (None: any), whatever the tenant.
    plain: dict[frozenset[str] | None, list[Prepared]] = defaultdict(list)
    others: list[Prepared] = []
    # BEGIN goes out with the claim and COMMIT after the last statement (pipeline mode).
    with pipelined_atomic():
        # One statement: the claims, their contexts and their executions' packages.
        claimed = sorted(claim_work(task_execution_ids, claimer, deadline=False), key=_claim_key)
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
            results.update(_place_plain(group, prelocked))
        for prepared in others:
            results[prepared.claim.task_execution_id] = placement.place_prepared(
                prepared, wait=not prelocked
            )
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
