"""Placing many Ready tasks on the fleet in ONE transaction (the fleet executor's hot path).

:func:`fleet.executors.fleet.delivery.placement.place_task` claims, prepares and reserves one
task per transaction: four statements, each planned and committed for one task,
which was most of the database's work per task.  :func:`place_tasks` does the
same for a batch:

* one claim statement for every task of the batch (:func:`claim_tasks`);
* per claim the same :func:`~fleet.executors.fleet.delivery.placement.prepare` (the shared
  context builder, the packet, the oversize and selector checks);
* *plain* tasks (no selector, no group or affinity binding — the common case) of
  one package are reserved and enqueued together in one statement
  (:func:`~fleet.executors.fleet.delivery.placement.reserve_and_enqueue`); every other task goes through
  :func:`~fleet.executors.fleet.delivery.placement.place_prepared` as if alone;
* one commit.

Either the whole batch commits or none of it; a batch that fails (a deadlock
with another server's batch, say) is placed again one task at a time, each in a
transaction of its own — the outcome per task is exactly what ``place_task``
would have given.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import defaultdict

from django.db import DatabaseError, transaction

from fleet.engine.claims import claim_tasks, release_claim
from fleet.engine.context import build_task_contexts
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

log = logging.getLogger(__name__)

Placement = Placed | NoAgent | NotClaimed


def _place_plain(group: list[Prepared]) -> dict[uuid.UUID, Placement]:
    # Timed like selection.select times one task: choosing and reserving (and enqueueing,
    # which is the same statement), one observation per task of the group.
    started = time.perf_counter()
    try:
        placed = placement.reserve_and_enqueue(group)
    finally:
        observe_selections(time.perf_counter() - started, len(group))
    results: dict[uuid.UUID, Placement] = {}
    reason = ""
    for prepared in group:
        claim = prepared.claim
        agent = placed.get(claim.task_execution_id)
        if agent is not None:
            results[claim.task_execution_id] = agent
            continue
        # No slot left (or the free agents are being reserved by someone else right now).
        reason = reason or no_capacity_reason(claim.tenant_id, prepared.triples)
        release_claim(claim.task_execution_id, claim.assignment, reason)
        results[claim.task_execution_id] = NoAgent(claim.tenant_id, reason)
    if placed:
        SELECTION_SUCCESS.labels(step=UNCONSTRAINED.step).inc(len(placed))
    if len(placed) < len(group):
        SELECTION_FAILURE.labels(reason="no_free_agent").inc(len(group) - len(placed))
        if "at capacity" in reason:
            BACKPRESSURE.labels(reason="agents_full").inc()
    return results


def _place_batch(task_execution_ids: list[uuid.UUID], claimer: str) -> dict[uuid.UUID, Placement]:
    results: dict[uuid.UUID, Placement] = {}
    plain: dict[tuple[int, int], list[Prepared]] = defaultdict(list)
    others: list[Prepared] = []
    with transaction.atomic():
        claims = sorted(claim_tasks(task_execution_ids, claimer, deadline=False), key=_claim_key)
        contexts = build_task_contexts([claim.task_execution_id for claim in claims])
        placement.prime_executions(claim.workflow_execution_id for claim in claims)
        for claim in claims:
            prepared = placement.prepare(claim, contexts[claim.task_execution_id])
            if isinstance(prepared, Unroutable):
                results[claim.task_execution_id] = prepared
            elif prepared.request.plain:
                plain[(claim.tenant_id, prepared.package.id)].append(prepared)
            else:
                others.append(prepared)
        # The plain groups first: their ordered lock of the agents must not come after a
        # single reservation already holds one agent out of order.
        for group in plain.values():
            results.update(_place_plain(group))
        for prepared in others:
            results[prepared.claim.task_execution_id] = placement.place_prepared(prepared)
    return results


def _claim_key(claim) -> str:
    return str(claim.task_execution_id)


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
