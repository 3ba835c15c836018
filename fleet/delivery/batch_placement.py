"""Placing many Ready tasks on the fleet in ONE transaction (the fleet executor's hot path).

:func:`fleet.delivery.placement.place_task` claims, prepares and reserves one
task per transaction: four statements, each planned and committed for one task,
which was most of the database's work per task.  :func:`place_tasks` does the
same for a batch:

* one claim statement for every task of the batch (:func:`claim_tasks`);
* per claim the same :func:`~fleet.delivery.placement.prepare` (the shared
  context builder, the packet, the oversize and selector checks);
* *plain* tasks (no selector, no group or affinity binding — the common case) of
  one package are reserved and enqueued together in one statement
  (:func:`reserve_and_enqueue`); every other task goes through
  :func:`~fleet.delivery.placement.place_prepared` as if alone;
* one commit.

Either the whole batch commits or none of it; a batch that fails (a deadlock
with another server's batch, say) is placed again one task at a time, each in a
transaction of its own — the outcome per task is exactly what ``place_task``
would have given.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections import defaultdict
from dataclasses import dataclass, field

from django.db import DatabaseError, connection, transaction

from fleet.delivery import local_sockets, placement
from fleet.delivery.placement import NoAgent, NotClaimed, Placed, Prepared, Unroutable
from fleet.engine.claims import RESULT_GRACE_S, claim_tasks, release_claim
from fleet.engine.context import build_task_contexts
from fleet.routing.health import DEGRADED_SQL
from fleet.routing.metrics import BACKPRESSURE, SELECTION_FAILURE, SELECTION_SUCCESS
from fleet.routing.reservation import candidate_params, candidates_sql, no_capacity_reason
from fleet.routing.selectors import CANDIDATES, UNCONSTRAINED

log = logging.getLogger(__name__)

Placement = Placed | NoAgent | NotClaimed

# The agents a batch may use, locked in id order — waiting for a result batch that is
# releasing slots (agent rows are held only for a statement and a commit, and every
# multi-agent writer locks them in id order, so this cannot deadlock) rather than
# skipping its agents as full — then ranked by the selection's own order
# (fleet.routing.selectors), and their free
# slots dealt out one per agent per round: healthy agents first, degraded ones only
# once every healthy slot is taken — spread like consecutive single reservations.
# A packet for an agent whose socket THIS process holds is written as delivered (its
# result clock started) and pushed by the caller right after the commit, without the
# relay's round trip; the others are pending, for the relay that holds their socket.
_RESERVE_AND_ENQUEUE = """
WITH locked AS (
    SELECT a.* FROM agents_agent a WHERE {candidates} ORDER BY a.id FOR UPDATE OF a
), ranked AS (
    SELECT a.id, a.name, a.target_triple, a.max_concurrency - a.in_flight AS free,
           a.connected_to = %(me)s AS local,
           ({degraded}) AS degraded, row_number() OVER (ORDER BY {order}) AS rank
    FROM locked a
), slots AS (
    SELECT r.id, r.name, r.target_triple, r.local,
           row_number() OVER (ORDER BY r.degraded, s.n, r.rank) AS k
    FROM ranked r CROSS JOIN LATERAL generate_series(1, LEAST(r.free, %(count)s)) AS s(n)
), work AS (
    SELECT w.task_id, w.assignment, w.payload, s.id AS agent_id, s.name, s.target_triple,
           s.local
    FROM unnest(%(tasks)s::uuid[], %(assignments)s::int[], %(payloads)s::jsonb[])
         WITH ORDINALITY AS w(task_id, assignment, payload, k)
    JOIN slots s ON s.k = w.k
), reserved AS (
    UPDATE agents_agent r SET in_flight = r.in_flight + c.n, last_selected_at = clock_timestamp()
    FROM (SELECT agent_id, count(*) AS n FROM work GROUP BY agent_id) c
    WHERE r.id = c.agent_id
), packets AS (
    INSERT INTO delivery_outbox (tenant_id, agent_id, task_id, assignment, state, payload,
                                 attempts, delivered_at, created_at, updated_at, former_agents)
    SELECT %(tenant)s, w.agent_id, w.task_id, w.assignment,
           CASE WHEN w.local THEN 'delivered' ELSE 'pending' END,
           w.payload || jsonb_build_object(
               'target_triple', w.target_triple,
               'artifact_digest', coalesce(%(digests)s::jsonb ->> w.target_triple, %(digest)s)
           ),
           CASE WHEN w.local THEN 1 ELSE 0 END, CASE WHEN w.local THEN now() END,
           now(), now(), '[]'::jsonb
    FROM work w
    RETURNING id, task_id, payload
), assigned AS (
    UPDATE fleet_taskexecution t SET agent_id = w.agent_id,
        result_deadline = CASE WHEN w.local
                               THEN now() + make_interval(secs => t.timeout_s + %(grace)s) END
    FROM work w
    WHERE t.id = w.task_id AND t.assignment = w.assignment
    RETURNING t.id, extract(epoch FROM now() - t.ready_at) AS waited_s
), relax AS (
    -- As for a single dispatch: a lost one leaves the tasks Ready (they run again), and
    -- the outcome's synchronous commit flushes it anyway.
    SELECT set_config('synchronous_commit', 'off', true)
)
SELECT w.task_id, w.agent_id, w.name, w.local, p.id, p.payload, a.waited_s
FROM work w JOIN packets p ON p.task_id = w.task_id JOIN assigned a ON a.id = w.task_id, relax
"""


@dataclass(frozen=True)
class Delivered(Placed):
    """Placed on an agent whose socket this process holds: the row is already delivered,
    the caller pushes ``packet`` (or, if it cannot, puts the row back to pending)."""

    outbox_id: int = 0
    packet: dict = field(default_factory=dict)
    waited_s: float = 0.0  # Ready → placed (the dispatch latency metric)


def _reserve_sql() -> str:
    candidates = candidates_sql(UNCONSTRAINED)
    return _RESERVE_AND_ENQUEUE.format(
        candidates=candidates,
        degraded=DEGRADED_SQL,
        order=UNCONSTRAINED.order.replace(CANDIDATES, candidates),
    )


def reserve_and_enqueue(group: list[Prepared]) -> dict[uuid.UUID, Placed]:
    """Reserve slots for plain tasks of ONE package (one tenant) and insert their packets,
    in one statement (the caller's transaction): task id → Placed (a :class:`Delivered`
    for a local agent) for those that got a slot; the rest got none."""
    first = group[0]
    params = {
        **UNCONSTRAINED.params,
        **candidate_params(first.claim.tenant_id, first.triples),
        "count": len(group),
        "me": local_sockets.server_id(),
        "grace": RESULT_GRACE_S,
        "tenant": first.claim.tenant_id,
        "tasks": [p.claim.task_execution_id for p in group],
        "assignments": [p.claim.assignment for p in group],
        "payloads": [json.dumps(p.payload) for p in group],
        "digests": json.dumps(first.digests or {}),
        "digest": first.package.digest,
    }
    claims = {p.claim.task_execution_id: p.claim for p in group}
    placed: dict[uuid.UUID, Placed] = {}
    with connection.cursor() as cursor:
        cursor.execute(_reserve_sql(), params)
        for task_id, agent_id, name, local, outbox_id, payload, waited_s in cursor.fetchall():
            claim = claims[task_id]
            if not local:
                placed[task_id] = Placed(claim.tenant_id, claim.assignment, agent_id, name)
                continue
            packet = json.loads(payload) if isinstance(payload, str) else dict(payload)
            packet["outbox_id"] = outbox_id
            placed[task_id] = Delivered(
                claim.tenant_id, claim.assignment, agent_id, name,
                outbox_id=outbox_id, packet=packet, waited_s=float(waited_s or 0.0),
            )  # fmt: skip
    return placed


def _place_plain(group: list[Prepared]) -> dict[uuid.UUID, Placement]:
    placed = reserve_and_enqueue(group)
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


def _place_batch(task_ids: list[uuid.UUID], claimer: str) -> dict[uuid.UUID, Placement]:
    results: dict[uuid.UUID, Placement] = {}
    plain: dict[tuple[int, int], list[Prepared]] = defaultdict(list)
    others: list[Prepared] = []
    with transaction.atomic():
        claims = sorted(claim_tasks(task_ids, claimer, deadline=False), key=_claim_key)
        contexts = build_task_contexts([claim.task_execution_id for claim in claims])
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


def place_tasks(task_ids: list[uuid.UUID], claimer: str) -> dict[uuid.UUID, Placement]:
    """Claim and place these tasks (see the module docstring): task id → Placed, NoAgent
    (claim released, the reason written), Unroutable (failed for good) or NotClaimed."""
    if not task_ids:
        return {}
    try:
        results = _place_batch(task_ids, claimer)
    except DatabaseError:
        if len(task_ids) == 1:
            raise
        log.warning(
            "placing a batch of %d tasks failed; placing them one by one",
            len(task_ids),
            exc_info=True,
        )
        results = {}
        for task_id in task_ids:
            try:
                results[task_id] = placement.place_task(task_id, claimer)
            except DatabaseError:
                log.exception("placing task %s failed", task_id)
                results[task_id] = NotClaimed("placement failed: the task stays Ready")
    return {task_id: results.get(task_id, NotClaimed()) for task_id in task_ids}
