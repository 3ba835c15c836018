"""Choosing the agent for one task: selectors, bindings, and why there is none.

:func:`select` is called inside the placement transaction (and by the liveness
sweep's reclaim) with a ``reserve`` callable that performs the one-statement
reservation for a compiled :class:`~fleet.executors.fleet.routing.selectors.Choice`.  It returns

* :class:`Chosen` — an agent's slot is reserved (and the task's bindings recorded);
* :class:`NoFreeAgent` — agents that match exist but none can take it now (full, no
  socket, below a floor, bound elsewhere): transient, the task waits;
* :class:`NoMatchingAgent` — live agents exist and none could ever take it, no agent pool
  that could run it can still grow (:mod:`~fleet.executors.fleet.routing.pool_match`), or
  its ``agent`` selector names no registered agent: permanent, the task fails.

With no live agent at all in the tenant the wait is transient (an agent may start).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from django.db import connection

from fleet.executors.fleet.routing import affinity, groups, pool_match
from fleet.executors.fleet.routing.affinity import BindingKey
from fleet.executors.fleet.routing.candidates import ReservedAgent, no_capacity_reason
from fleet.executors.fleet.routing.metrics import (
    BACKPRESSURE,
    SELECTION_DURATION,
    SELECTION_FAILURE,
    SELECTION_SUCCESS,
)
from fleet.executors.fleet.routing.selectors import UNCONSTRAINED, Choice, Selectors, compile_choice
from fleet.executors.fleet.state import breaker, ledger
from fleet.models import Tenant
from fleet.platform.config import get_config

AGENTS_LISTED = 5  # agents named in a NoMatchingAgent message


@dataclass(frozen=True)
class Request:
    """What selection needs to know about one task."""

    tenant_id: int
    selectors: Selectors
    keys: tuple[BindingKey, ...] = ()  # binding keys, in precedence order (group first)

    @property
    def plain(self) -> bool:
        """No selector and no binding: the fast path of the common task."""
        return not self.keys and not self.selectors.filters


@dataclass(frozen=True)
class Chosen:
    agent: ReservedAgent
    step: str


@dataclass(frozen=True)
class NoFreeAgent:
    reason: str
    at_capacity: bool = False  # every matching agent was full: back-pressure


@dataclass(frozen=True)
class NoMatchingAgent:
    reason: str
    error_type: str = "NoMatchingAgent"


@dataclass
class _Census:
    live: int = 0
    matching: int = 0
    registered_matching: int = 0  # not dead, whatever their heartbeat (direct selectors)
    connected: int = 0
    loadable: int = 0
    free_now: int = 0  # matching, connected, loadable and meeting the dynamic selectors
    shut: int = 0  # of those, the ones whose circuit breaker lets no work through now
    named_registered: bool = True
    bound_matches: bool = True
    agents: list[str] = field(default_factory=list)


def request_for(
    tenant_id: int,
    routing: dict | None,
    workflow_execution_id: uuid.UUID,
    workflow_name: str,
    context: dict,
) -> Request:
    """The request of a task (SelectorError for routing keys that cannot be used)."""
    selectors = Selectors.from_routing(routing)
    keys = [
        groups.group_key(workflow_execution_id, selectors.group),
        affinity.affinity_key(selectors.affinity, workflow_name, context),
    ]
    return Request(tenant_id, selectors, tuple(k for k in keys if k is not None))


def select(
    request: Request,
    triples: Iterable[str] | None,
    reserve: Callable[[Choice], ReservedAgent | None],
) -> Chosen | NoFreeAgent | NoMatchingAgent:
    """Reserve an agent for the task, or say why there is none (module docstring)."""
    started = time.perf_counter()
    try:
        outcome = _select(request, list(triples) if triples is not None else None, reserve)
    finally:
        SELECTION_DURATION.observe(time.perf_counter() - started)
    if isinstance(outcome, Chosen):
        SELECTION_SUCCESS.labels(step=outcome.step).inc()
    elif isinstance(outcome, NoFreeAgent):
        SELECTION_FAILURE.labels(reason="no_free_agent").inc()
        if outcome.at_capacity:
            BACKPRESSURE.labels(reason="agents_full").inc()
    else:
        SELECTION_FAILURE.labels(reason="no_matching_agent").inc()
    return outcome


def _select(request, triples, reserve) -> Chosen | NoFreeAgent | NoMatchingAgent:
    selectors = request.selectors
    keys = list(request.keys)
    bound = None
    if keys:
        affinity.lock(request.tenant_id, keys)
        bound = affinity.bound_agent(request.tenant_id, keys)
    if bound is not None:
        agent_id, key = bound
        chosen = reserve(compile_choice(selectors, agent_id))
        if chosen is not None:
            affinity.bind(request.tenant_id, keys, chosen.id)
            return Chosen(chosen, "group" if key.kind == "group" else "affinity")
        census = _census(request.tenant_id, triples, selectors, agent_id)
        if census.bound_matches:
            return _no_agent(request, triples, census, bound=(agent_id, key))
        # The bound agent cannot run this task (its selectors differ): choose freely.
    choice = UNCONSTRAINED if request.plain else compile_choice(selectors)
    chosen = reserve(choice)
    if chosen is not None:
        affinity.bind(request.tenant_id, keys, chosen.id)
        return Chosen(chosen, choice.step)
    return _no_agent(request, triples, _census(request.tenant_id, triples, selectors), None)


def _census(tenant_id, triples, selectors: Selectors, bound_agent_id=None) -> _Census:
    config = get_config()
    choice = compile_choice(selectors)
    params = {
        **choice.params,
        "tenant": tenant_id,
        "window": config.liveness_window_s,
        "any_triple": triples is None,
        "triples": sorted(triples or []),
        "bound": bound_agent_id,
        "named": selectors.agent or "",
    }
    live = "a.state = 'live' AND a.last_heartbeat > now() - make_interval(secs => %(window)s)"
    matching = f"{live} AND {choice.static}"
    connected = f"{matching} AND a.connected_to <> ''"
    loadable = f"{connected} AND (%(any_triple)s OR a.target_triple = ANY(%(triples)s))"
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            SELECT count(*) FILTER (WHERE {live}),
                   count(*) FILTER (WHERE {matching}),
                   count(*) FILTER (WHERE {choice.static}),
                   count(*) FILTER (WHERE {connected}),
                   count(*) FILTER (WHERE {loadable}),
                   count(*) FILTER (WHERE {loadable} AND {choice.dynamic}),
                   count(*) FILTER (WHERE {loadable} AND {choice.dynamic}
                                      AND NOT {breaker.admits("a")}),
                   bool_or(a.name = %(named)s),
                   coalesce(bool_or(a.id = %(bound)s AND {choice.static}), false),
                   (array_agg(a.name || CASE WHEN a.exclusive THEN ' (exclusive' ELSE ' (' END
                              || 'tags [' || array_to_string(ARRAY(SELECT jsonb_array_elements_text(a.tags)), ', ')
                              || '], capabilities ['
                              || array_to_string(ARRAY(SELECT jsonb_array_elements_text(a.capabilities)), ', ')
                              || '])' ORDER BY a.name) FILTER (WHERE {live}))[1:{AGENTS_LISTED}]
            FROM {ledger.AGENTS} a WHERE a.tenant_id = %(tenant)s AND a.state IN ('live', 'draining')
            """,
            params,
        )
        row = cursor.fetchone()
    return _Census(
        live=row[0],
        matching=row[1],
        registered_matching=row[2],
        connected=row[3],
        loadable=row[4],
        free_now=row[5],
        shut=row[6],
        named_registered=bool(row[7]) or not selectors.agent,
        bound_matches=bool(row[8]),
        agents=list(row[9] or []),
    )


def _no_agent(
    request: Request, triples, census: _Census, bound: tuple[uuid.UUID, BindingKey] | None
) -> NoFreeAgent | NoMatchingAgent:
    selectors = request.selectors
    tenant = Tenant.objects.filter(pk=request.tenant_id).values_list("name", flat=True).first()
    if not census.named_registered:
        return NoMatchingAgent(
            f"no agent named {selectors.agent!r} is registered in tenant {tenant}"
        )
    if census.live == 0:
        return NoFreeAgent(f"no live agent in tenant {tenant}")
    # A named agent that is registered may come back from a silence; other selectors are
    # judged on the agents alive now.
    could_match = census.registered_matching if selectors.agent else census.matching
    if could_match == 0:
        wanted = selectors.static_text() or "untargeted work"
        listed = "; ".join(census.agents)
        more = census.live - len(census.agents)
        listed += f"; and {more} more" if more > 0 else ""
        what = (
            f"matches {wanted}"
            if selectors.static_text()
            else "accepts untargeted work (every one is exclusive)"
        )
        # A pool that could run it and can still grow (or is starting agents): wait for it.
        waiting = pool_match.scalable_pool_reason(request.tenant_id, selectors)
        if waiting is not None:
            return NoFreeAgent(waiting)
        return NoMatchingAgent(
            f"none of the {census.live} live agent(s) of tenant {tenant} {what}: {listed}"
        )
    if request.plain:
        # Keep the plain task's long-standing wording (the console and API show it).
        reason = no_capacity_reason(request.tenant_id, triples)
        return NoFreeAgent(reason, at_capacity="at capacity" in reason)
    if bound is not None:
        agent_id, key = bound
        name, why = _bound_state(agent_id, selectors)
        what = "group" if key.kind == "group" else f"affinity ({key.kind})"
        return NoFreeAgent(
            f"NoFreeAgent: waiting for agent {name}, bound by its {what}: {why}",
            at_capacity=why.startswith("at capacity"),
        )
    if census.matching == 0:
        return NoFreeAgent(
            f"NoFreeAgent: agent {selectors.agent!r} is registered but sent no heartbeat "
            "within the liveness window"
        )
    matching = f"{census.matching} live agent(s) match ({selectors.static_text() or 'any'})"
    if census.connected == 0:
        return NoFreeAgent(f"NoFreeAgent: {matching} but none is connected")
    if census.loadable == 0:
        wanted = ", ".join(sorted(triples or []))
        return NoFreeAgent(
            f"NoFreeAgent: {matching} but none can load this package (needs {wanted})"
        )
    if census.free_now == 0:
        return NoFreeAgent(f"NoFreeAgent: {matching} but none has {selectors.floors_text()} now")
    if census.shut == census.free_now:
        return NoFreeAgent(
            f"NoFreeAgent: {matching}; the circuit breaker of all {census.shut} that could "
            "take it is open (no new work until its cool-off ends)"
        )
    return NoFreeAgent(
        f"NoFreeAgent: {matching}; all {census.free_now} that could take it are at capacity",
        at_capacity=True,
    )


def _bound_state(agent_id: uuid.UUID, selectors: Selectors) -> tuple[str, str]:
    """The bound agent's name and why it cannot take the task now."""
    config = get_config()
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            SELECT name, in_flight, max_concurrency, connected_to <> '',
                   extract(epoch FROM now() - last_heartbeat)
            FROM {ledger.AGENTS} WHERE id = %s
            """,
            [agent_id],
        )
        row = cursor.fetchone()
    if row is None:
        return str(agent_id), "it is gone"
    name, in_flight, slots, connected, silent_s = row
    if not connected:
        return name, "it has no delivery socket"
    if silent_s > config.liveness_window_s:
        return name, f"it has sent no heartbeat for {silent_s:.0f}s"
    if in_flight >= slots:
        return name, f"at capacity ({in_flight} of {slots} slots)"
    return name, f"it has not {selectors.floors_text() or 'the triple this package needs'} now"
