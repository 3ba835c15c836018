"""The agents a task may be placed on (candidates), and why there is none.

Candidates: live (heartbeat within the liveness window), same tenant, connected to
some server (a socket: unhealthy agents are never chosen), able to load the artifact
(target triple), a free slot, a circuit breaker that lets work through (closed, or
half-open with its one probe not yet placed: :mod:`fleet.executors.fleet.state.breaker`) — and whatever the task's selectors ask
(:mod:`fleet.executors.fleet.routing.selectors`: a :class:`~fleet.executors.fleet.routing.selectors.Choice` carries
their SQL and the ranking: most free slots first, then healthy before degraded, then the
host score, then the least recently selected).  The reservation that takes a candidate's
slot is the placement's (:func:`fleet.executors.fleet.delivery.placement.reserve_agent`,
from the ledger's fragments).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from django.db import connection

from fleet.executors.fleet.routing.health import degraded_after_s
from fleet.executors.fleet.routing.selectors import Choice
from fleet.executors.fleet.state import breaker, ledger
from fleet.models import Tenant
from fleet.platform.config import get_config

_LIVE_WITH_ROOM = f"""
    a.state = 'live' AND a.connected_to <> ''
    AND {ledger.has_free_slot("a")} AND {breaker.admits("a")}
    AND a.last_heartbeat > now() - make_interval(secs => %(window)s)
"""
_BASE = f"""
    a.tenant_id = %(tenant)s AND {_LIVE_WITH_ROOM}
    AND (%(any_triple)s OR a.target_triple = ANY(%(triples)s))
"""
# The candidates of several tenants at once (one triples filter for them all): the batch
# reservation's (ledger.RESERVE_AND_ENQUEUE), which deals each tenant's slots to its tasks.
_BASE_OF_TENANTS = f"""
    a.tenant_id = ANY(%(tenants)s) AND {_LIVE_WITH_ROOM}
    AND (%(any_triple)s OR a.target_triple = ANY(%(triples)s))
"""
# The candidates of several (tenant, triples) groups at once, whatever their selectors
# (``%(groups)s``: JSON ``[{"tenant": id, "triples": [..] or null}, ..]``): a superset of
# what any task of those groups may be placed on, for the placement batch's up-front lock.
_OF_GROUPS = f"""
    a.tenant_id = ANY(%(tenants)s) AND {_LIVE_WITH_ROOM}
    AND EXISTS (
        SELECT 1 FROM jsonb_to_recordset(%(groups)s::jsonb) AS g(tenant bigint, triples text[])
        WHERE g.tenant = a.tenant_id AND (g.triples IS NULL OR a.target_triple = ANY(g.triples))
    )
"""


def candidates_sql(choice: Choice) -> str:
    """SQL over ``agents_agent a``: the agents ``choice`` may place a task on."""
    return f"{_BASE} AND {choice.static} AND {choice.dynamic}"


@dataclass(frozen=True)
class ReservedAgent:
    """The agent whose slot a reservation took."""

    id: uuid.UUID
    name: str
    target_triple: str


def tenants_candidates_sql(choice: Choice) -> str:
    """:func:`candidates_sql` for the tenants in ``%(tenants)s`` at once (parameters:
    :func:`candidate_params` with ``tenants`` added)."""
    return f"{_BASE_OF_TENANTS} AND {choice.static} AND {choice.dynamic}"


def group_candidates_sql() -> str:
    """SQL over ``agents_agent a``: every agent a task of any group in
    :func:`group_candidate_params` may be placed on (selectors left out: a superset)."""
    return _OF_GROUPS


def group_candidate_params(groups: Iterable[tuple[int, Iterable[str] | None]]) -> dict:
    """The parameters of :func:`group_candidates_sql` for these (tenant, triples) groups
    (triples None: any)."""
    wanted = {
        (tenant_id, None if triples is None else tuple(sorted(triples)))
        for tenant_id, triples in groups
    }
    return {
        "tenants": sorted({tenant_id for tenant_id, _ in wanted}),
        "window": get_config().liveness_window_s,
        "groups": json.dumps(
            [{"tenant": t, "triples": None if tr is None else list(tr)} for t, tr in wanted]
        ),
    }


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


_LOADABLE = "a.connected_to <> '' AND (%(any_triple)s OR a.target_triple = ANY(%(triples)s))"
_CAPACITY_CENSUS = f"""
SELECT count(*),
       count(*) FILTER (WHERE a.connected_to <> ''),
       count(*) FILTER (WHERE {_LOADABLE}),
       count(*) FILTER (WHERE {_LOADABLE} AND NOT {breaker.admits("a")})
FROM {ledger.AGENTS} a WHERE a.tenant_id = %(tenant)s AND a.state = 'live'
  AND a.last_heartbeat > now() - make_interval(secs => %(window)s)
"""


def no_capacity_reason(tenant_id: int, triples: Iterable[str] | None = None) -> str:
    """Why no agent could be reserved for a task without selectors, in words for the
    console and the API (tasks with selectors: :mod:`fleet.executors.fleet.routing.selection`)."""
    tenant_name = Tenant.objects.filter(pk=tenant_id).values_list("name", flat=True).first()
    with connection.cursor() as cursor:
        cursor.execute(_CAPACITY_CENSUS, candidate_params(tenant_id, triples))
        live, connected, loadable, shut = cursor.fetchone()
    if live == 0:
        return f"no live agent in tenant {tenant_name}"
    if connected == 0:
        return f"none of the {live} live agent(s) of tenant {tenant_name} is connected"
    if loadable == 0:
        wanted = ", ".join(sorted(triples or []))
        return f"no live agent of tenant {tenant_name} can load this package (needs {wanted})"
    if shut == loadable:
        return (
            f"the circuit breaker of all {loadable} live agent(s) that could take it is open "
            "(no new work until its cool-off ends)"
        )
    shut_text = f" ({shut} with an open circuit breaker)" if shut else ""
    if loadable == 1:
        return "the 1 live agent is at capacity"
    return f"all {loadable} live agents are at capacity{shut_text}"
