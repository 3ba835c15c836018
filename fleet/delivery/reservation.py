"""Choosing an agent and reserving one of its slots, in one statement.

Selection: live (heartbeat within the liveness window), same tenant, connected to some server, able to load the
artifact (target triple), spare capacity; most free capacity first.  The
slot is taken by ``in_flight = in_flight + 1`` in the same UPDATE that picks
the row (``FOR UPDATE SKIP LOCKED``), and the UPDATE re-checks the capacity,
so two dispatches never overfill an agent whatever the heartbeats said.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from django.db import connection

from cloacina_site.config import get_config
from fleet.models import Tenant

_CANDIDATES = """
    tenant_id = %(tenant)s AND state = 'live' AND connected_to <> ''
    AND in_flight < max_concurrency
    AND last_heartbeat > now() - make_interval(secs => %(window)s)
    AND (%(any_triple)s OR target_triple = ANY(%(triples)s))
"""

_RESERVE = f"""
    UPDATE agents_agent AS a SET in_flight = a.in_flight + 1
    WHERE a.id = (
        SELECT id FROM agents_agent
        WHERE {_CANDIDATES}
        ORDER BY max_concurrency - in_flight DESC, last_heartbeat DESC
        LIMIT 1 FOR UPDATE {{skip}}
    ) AND a.state = 'live' AND a.in_flight < a.max_concurrency
    RETURNING a.id, a.name, a.target_triple
"""

# Rounds of SKIP LOCKED before one blocking attempt: a row locked by a concurrent
# reservation may still have room once that transaction commits.
SKIP_LOCKED_ROUNDS = 2


@dataclass(frozen=True)
class ReservedAgent:
    id: uuid.UUID
    name: str
    target_triple: str


def _params(tenant_id: int, triples: Iterable[str] | None) -> dict:
    return {
        "tenant": tenant_id,
        # An agent past its liveness window is about to be evicted: never hand it work.
        "window": get_config().liveness_window_s,
        "any_triple": triples is None,
        "triples": sorted(triples) if triples is not None else [],
    }


def reserve_agent(
    tenant_id: int,
    triples: Iterable[str] | None = None,
    then_sql: str = "SELECT id, name, target_triple FROM reserved",
    then_params: dict | None = None,
) -> ReservedAgent | None:
    """Take a slot on the best agent for the tenant, or None when no agent has room.

    ``triples`` limits the choice to agents of those target triples (None: any).
    ``then_sql`` runs in the same statement after the reservation (the CTE
    ``reserved`` holds the chosen agent), so a caller can insert what the slot is
    for without holding the agent's row lock any longer than the statement and the
    commit (:func:`fleet.delivery.outbox.enqueue_on_best_agent`).  Runs in the
    caller's transaction; the slot is released by acking the outbox row
    (:func:`fleet.engine.outbox_ack.ack_and_release`).
    """
    params = {**_params(tenant_id, triples), **(then_params or {})}
    with connection.cursor() as cursor:
        for _ in range(SKIP_LOCKED_ROUNDS):
            cursor.execute(
                f"WITH reserved AS ({_RESERVE.format(skip='SKIP LOCKED')}) {then_sql}", params
            )
            row = cursor.fetchone()
            if row is not None:
                return ReservedAgent(*row)
            cursor.execute(
                f"SELECT EXISTS (SELECT 1 FROM agents_agent WHERE {_CANDIDATES})", params
            )
            if not cursor.fetchone()[0]:
                return None  # nothing to wait for: every candidate is full or absent
        # Candidates exist but are locked by concurrent reservations: wait for one; the
        # UPDATE re-checks in_flight < max_concurrency on the committed row.
        cursor.execute(f"WITH reserved AS ({_RESERVE.format(skip='')}) {then_sql}", params)
        row = cursor.fetchone()
        return ReservedAgent(*row) if row is not None else None


def no_capacity_reason(tenant_id: int, triples: Iterable[str] | None = None) -> str:
    """Why no agent could be reserved, in words for the console and the API."""
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
            _params(tenant_id, triples),
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
