"""Choosing an agent and reserving one of its slots, in one statement.

Candidates: live (heartbeat within the liveness window), same tenant, connected to
some server (a socket: unhealthy agents are never chosen), able to load the artifact
(target triple), a free slot — and whatever the task's selectors ask
(:mod:`fleet.routing.selectors`: a :class:`~fleet.routing.selectors.Choice` carries
their SQL and the ranking: degraded agents last, then round-robin or the fallback
score).  The slot is taken by ``in_flight = in_flight + 1`` in the same UPDATE that
picks the row (``FOR UPDATE SKIP LOCKED``), and the UPDATE re-checks the state and the
capacity on the locked row, so two dispatches never overfill an agent whatever the
heartbeats said.  ``last_selected_at`` is stamped in that UPDATE: it is the
round-robin's memory.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from django.db import connection

from cloacina_site.config import get_config
from fleet.models import Tenant
from fleet.routing.health import degraded_after_s
from fleet.routing.selectors import CANDIDATES, UNCONSTRAINED, Choice

_BASE = """
    a.tenant_id = %(tenant)s AND a.state = 'live' AND a.connected_to <> ''
    AND a.in_flight < a.max_concurrency
    AND a.last_heartbeat > now() - make_interval(secs => %(window)s)
    AND (%(any_triple)s OR a.target_triple = ANY(%(triples)s))
"""


def candidates_sql(choice: Choice) -> str:
    return f"{_BASE} AND {choice.static} AND {choice.dynamic}"


def _reserve_sql(choice: Choice, skip: str) -> str:
    candidates = candidates_sql(choice)
    order = choice.order.replace(CANDIDATES, candidates)
    return f"""
    UPDATE agents_agent AS r
    SET in_flight = r.in_flight + 1, last_selected_at = clock_timestamp()
    WHERE r.id = (
        SELECT a.id FROM agents_agent a
        WHERE {candidates}
        ORDER BY {order}
        LIMIT 1 FOR UPDATE OF a {skip}
    ) AND r.state = 'live' AND r.in_flight < r.max_concurrency
    RETURNING r.id, r.name, r.target_triple
    """


# Rounds of SKIP LOCKED before one blocking attempt: a row locked by a concurrent
# reservation may still have room once that transaction commits.
SKIP_LOCKED_ROUNDS = 2


@dataclass(frozen=True)
class ReservedAgent:
    id: uuid.UUID
    name: str
    target_triple: str


def candidate_params(tenant_id: int, triples: Iterable[str] | None) -> dict:
    config = get_config()
    return {
        "tenant": tenant_id,
        # An agent past its liveness window is about to be evicted: never hand it work.
        "window": config.liveness_window_s,
        "degraded_s": degraded_after_s(config.heartbeat_interval_s),
        "any_triple": triples is None,
        "triples": sorted(triples) if triples is not None else [],
    }


def reserve_agent(
    tenant_id: int,
    triples: Iterable[str] | None = None,
    then_sql: str = "SELECT id, name, target_triple FROM reserved",
    then_params: dict | None = None,
    choice: Choice | None = None,
) -> ReservedAgent | None:
    """Take a slot on the best agent for the tenant, or None when no agent has room.

    ``triples`` limits the choice to agents of those target triples (None: any);
    ``choice`` adds the task's selectors (None: none).  ``then_sql`` runs in the same
    statement after the reservation (the CTE ``reserved`` holds the chosen agent), so
    a caller can insert what the slot is for without holding the agent's row lock any
    longer than the statement and the commit
    (:func:`fleet.delivery.outbox.enqueue_on_best_agent`).  Runs in the caller's
    transaction; the slot is released by acking the outbox row
    (:func:`fleet.delivery.outbox_ack.ack_and_release`).
    """
    choice = choice or UNCONSTRAINED
    params = {**choice.params, **candidate_params(tenant_id, triples), **(then_params or {})}
    with connection.cursor() as cursor:
        for _ in range(SKIP_LOCKED_ROUNDS):
            sql = _reserve_sql(choice, "SKIP LOCKED")
            cursor.execute(f"WITH reserved AS ({sql}) {then_sql}", params)
            row = cursor.fetchone()
            if row is not None:
                return ReservedAgent(*row)
            cursor.execute(
                f"SELECT EXISTS (SELECT 1 FROM agents_agent a WHERE {candidates_sql(choice)})",
                params,
            )
            if not cursor.fetchone()[0]:
                return None  # nothing to wait for: every candidate is full or absent
        # Candidates exist but are locked by concurrent reservations: wait for one; the
        # UPDATE re-checks in_flight < max_concurrency on the committed row.
        cursor.execute(f"WITH reserved AS ({_reserve_sql(choice, '')}) {then_sql}", params)
        row = cursor.fetchone()
        return ReservedAgent(*row) if row is not None else None


def no_capacity_reason(tenant_id: int, triples: Iterable[str] | None = None) -> str:
    """Why no agent could be reserved for a task without selectors, in words for the
    console and the API (tasks with selectors: :mod:`fleet.routing.selection`)."""
    tenant_name = Tenant.objects.filter(pk=tenant_id).values_list("name", flat=True).first()
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT count(*),
                   count(*) FILTER (WHERE connected_to <> ''),
                   count(*) FILTER (WHERE connected_to <> '' AND (%(any_triple)s OR target_triple = ANY(%(triples)s)))
            FROM agents_agent WHERE tenant_id = %(tenant)s AND state = 'live'
              AND last_heartbeat > now() - make_interval(secs => %(window)s)
            """,
            candidate_params(tenant_id, triples),
        )
        live, connected, loadable = cursor.fetchone()
    if live == 0:
        return f"no live agent in tenant {tenant_name}"
    if connected == 0:
        return f"none of the {live} live agent(s) of tenant {tenant_name} is connected"
    if loadable == 0:
        wanted = ", ".join(sorted(triples or []))
        return f"no live agent of tenant {tenant_name} can load this package (needs {wanted})"
    if loadable == 1:
        return "the 1 live agent is at capacity"
    return f"all {loadable} live agents are at capacity"
