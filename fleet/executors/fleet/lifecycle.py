"""An agent's lifecycle: the one owner of its transitions on ``agents_agent``.

::

    register ──▶ live ──drain──▶ draining ──┬──evict / retire──▶ dead     (final)
      ▲   │        │                         └──deregister─────▶ stopped  (final)
      │   └─ replace (same name: the old one is evicted)
      └──────────── a dead or stopped agent registers anew (a new row) ◀───────┘

* **register** — a new row, under the tenant's roster lock; a live agent of the same
  name is **replaced** (evicted, its work reclaimed).  The request checks (protocol,
  limits, the tenant's cap) are :mod:`fleet.executors.fleet.roster`'s, run under the lock here.
* **beat / connect / disconnect** — heartbeats (an agent may declare itself draining),
  and which server holds its delivery socket (``connection_generation``: the newest
  connection owns the agent).
* **drain** — on request (API, console) or by an actuator scaling down: no new work,
  a deadline, its group/affinity bindings cleared at once.  The agent finishes and
  deregisters; past the deadline the sweep evicts it.
* **evict** — declared dead once (a compare-and-set on the locked row), an
  :class:`~fleet.models.Eviction` recorded, bindings cleared, its slots cleared and
  its open packets reclaimed onto survivors (:mod:`fleet.executors.fleet.delivery.liveness`).
  The liveness sweep evicts silent agents and overdue drains.
* **retire** — revoking an API key declares the agents registered with it dead at
  once (their sockets close at the next beat, re-registering is refused).
* **deregister** — a clean exit (SIGTERM, a deprovision's drain): the agent is
  **stopped**, not dead; work it still held moves on as for an eviction.

Every transition is counted by phase (:mod:`fleet.executors.fleet.routing.phases`:
connecting, ready, busy, draining, disconnected, stopped, dead) in
``cloacina_fleet_agent_phase_transitions_total{from,to}``, here where it happens; only
ready ⇄ busy, which follows the slot counter on the hot path, is derived and not counted.

Slot accounting is the ledger's (:mod:`fleet.executors.fleet.state.ledger`): this module clears a dead
agent's slots with its fragment and never writes ``in_flight`` otherwise.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import IntegrityError, connection, transaction
from django.utils import timezone
from prometheus_client import Counter

from agents.models import ACTIVE_STATES, Agent, AgentState
from fleet.executors.fleet.delivery.liveness import reclaim_in_flight, reclaim_orphaned_work
from fleet.executors.fleet.routing import affinity, groups, phases
from fleet.executors.fleet.routing.phases import Phase
from fleet.executors.fleet.state import ledger
from fleet.models import ApiKey, Eviction
from fleet.platform import key_cache
from fleet.platform.config import get_config
from fleet.platform.errors import DomainError, ErrorKind
from fleet.platform.pipelined_tx import pipelined_atomic

log = logging.getLogger(__name__)

REGISTER_ATTEMPTS = 3  # a concurrent registration of the same name may win the unique index
ROSTER_LOCK_CLASS = 0x524F5354  # pg_advisory_xact_lock(class, tenant id) around the cap check

MAX_DRAIN_TIMEOUT_S = 7 * 24 * 3600.0

PHASE_TRANSITIONS = Counter(
    "cloacina_fleet_agent_phase_transitions",
    "Agent phase transitions (from → to; 'new' is a registration) counted by the server "
    "process that made them; ready ⇄ busy follows the slot counter and is not counted.",
    ["from", "to"],
)


def _moved(before: str, after: str) -> None:
    """Count one phase transition (none when the phase did not change)."""
    if before != after:
        PHASE_TRANSITIONS.labels(before, after).inc()


def _moved_from(row: tuple, after: str) -> None:
    """Count the transition from the phase a row's :data:`phases.BEFORE` columns give."""
    _moved(phases.of(*row), after)


# -- register and replace --------------------------------------------------------------


@dataclass(frozen=True)
class RegistrationBounds:
    """Which registrations a registration's rate limits count: those made since ``since``
    with the key ``key_id`` (when ``per_key``) and in the tenant (when ``per_tenant``)."""

    key_id: int
    since: datetime
    per_key: bool
    per_tenant: bool


@dataclass(frozen=True)
class RosterCounts:
    """The tenant's roster as a registration finds it under the roster lock."""

    key_recent: int | None  # registrations with the key in the window (None: not counted)
    tenant_recent: int | None  # registrations in the tenant in the window (None: not counted)
    active: int  # agents that are not dead (live or draining)
    holder: uuid.UUID | None  # the live or draining agent of the same name, if any


# Everything a registration's bounds need, in one statement under the lock (it was five
# ORM queries, and the same ones again before the lock).  A count that is not needed is
# not made: a subquery in a CASE branch that is not taken does not run.
_ROSTER_COUNTS = """
SELECT
    CASE WHEN %(per_key)s THEN (SELECT count(*) FROM agents_agent
        WHERE api_key_id = %(key)s AND registered_at > %(since)s) END,
    CASE WHEN %(per_tenant)s THEN (SELECT count(*) FROM agents_agent
        WHERE tenant_id = %(tenant)s AND registered_at > %(since)s) END,
    (SELECT count(*) FROM agents_agent
        WHERE tenant_id = %(tenant)s AND state IN ('live', 'draining')),
    (SELECT id FROM agents_agent
        WHERE tenant_id = %(tenant)s AND name = %(name)s AND state IN ('live', 'draining'))
"""


def register(
    tenant_id: int,
    name: str,
    fields: dict,
    bounds: RegistrationBounds,
    admit: Callable[[RosterCounts], None],
    connected_to: str = "",
) -> Agent | None:
    """Create the agent ``name`` of the tenant (``fields``: the rest of its row); a live
    agent of the same name is replaced.  ``admit`` gets the roster's counts under the
    tenant's roster lock and raises to refuse (the caller's limits, exact under the lock).
    ``connected_to``: the server that holds the socket the agent registered on, written
    with the row as :func:`connect` would write it (generation 1), so a registration on
    the socket is one INSERT and not an INSERT then an UPDATE of the same row.
    None when concurrent registrations of the name kept winning the unique index."""
    if connected_to:
        fields = {**fields, "connected_to": connected_to, "connection_generation": 1}
    for _ in range(REGISTER_ATTEMPTS):
        try:
            # BEGIN travels with the lock and COMMIT with the INSERT (pipeline mode): a
            # connect storm is thousands of these, and two of their round trips carried no
            # work (fleet/platform/pipelined_tx.py).
            with pipelined_atomic() as tx:
                # Registrations of one tenant take turns here: both bounds are exact, and a
                # same-name agent is replaced only by a registration that is let in.  The
                # counts are a statement of their own, after the lock: a statement's
                # snapshot is taken when it starts, and must see the turn before ours.
                # PostgreSQL runs a pipeline's statements one after the other, so the
                # counts travel with BEGIN and the lock (one round trip) and still start
                # only once the lock is held.
                with connection.cursor() as cursor:
                    cursor.execute(
                        "SELECT pg_advisory_xact_lock(%s, %s)", [ROSTER_LOCK_CLASS, tenant_id]
                    )
                    cursor.execute(_ROSTER_COUNTS, _counts_params(tenant_id, name, bounds))
                    tx.sync()
                    counts = RosterCounts(*cursor.fetchone())
                admit(counts)
                if counts.holder is not None:
                    replace(counts.holder)
                tx.pipeline_tail()  # a name taken meanwhile: IntegrityError at the COMMIT
                agent = _insert(Agent(tenant_id=tenant_id, name=name, **fields))
        except IntegrityError:
            continue  # a concurrent registration took the name first: replace that one
        _moved(phases.NEW, Phase.CONNECTING)
        if connected_to:  # counted as the connect that it folds in
            _moved(Phase.CONNECTING, phases.of(agent.state, True, 1, 0, agent.max_concurrency))
        return agent
    return None


def _insert(agent: Agent) -> Agent:
    """INSERT ``agent`` (its defaults filled by the model) as ``Model.save`` would, without
    the ORM's query compiler: compiling the INSERT was the largest share of a
    registration's CPU.  No signal handler listens to Agent saves."""
    fields = Agent._meta.concrete_fields
    with connection.cursor() as cursor:
        cursor.execute(
            _insert_sql(),
            [field.get_db_prep_save(getattr(agent, field.attname), connection) for field in fields],
        )
    agent._state.adding = False
    agent._state.db = connection.alias
    return agent


@functools.cache
def _insert_sql() -> str:
    columns = [field.column for field in Agent._meta.concrete_fields]
    return (
        f"INSERT INTO {Agent._meta.db_table} ({', '.join(columns)}) "
        f"VALUES ({', '.join(['%s'] * len(columns))})"
    )


def _counts_params(tenant_id: int, name: str, bounds: RegistrationBounds) -> dict:
    return {
        "tenant": tenant_id,
        "name": name,
        "key": bounds.key_id,
        "since": bounds.since,
        "per_key": bounds.per_key,
        "per_tenant": bounds.per_tenant,
    }


def replace(agent_id: uuid.UUID) -> Eviction | None:
    """A restarted agent registered again under its name: the old row is evicted."""
    return evict_agent(agent_id, "replaced by a new registration with the same name")


# -- heartbeats and the delivery socket ------------------------------------------------

_BEAT = f"""
WITH old AS (
    SELECT a.id, {phases.columns("a")} FROM agents_agent a
    WHERE a.id = %(agent)s AND a.tenant_id = %(tenant)s AND a.state IN ('live', 'draining')
    FOR UPDATE
)
UPDATE agents_agent a SET last_heartbeat = now(),
    metrics = CASE WHEN %(has)s THEN %(metrics)s::jsonb ELSE a.metrics END,
    state = CASE WHEN %(draining)s AND a.state = 'live' THEN 'draining' ELSE a.state END
FROM old WHERE a.id = old.id
RETURNING a.state, a.drain_requested_at IS NOT NULL, {phases.before("old")}
"""


# The socket writer's batched beats (fleet/executors/fleet/socket_writes.py).  The agent rows
# are locked in id order first, as every writer of several agent rows does (placement
# batches, result batches), and a row locked right now is skipped, not waited for: one
# result batch holding its agents' rows would otherwise hold up the beats of every agent
# in the round (and a busy server's beats queued behind them got healthy agents evicted).
# A skipped beat is written in a later round (BEAT_PENDING tells skipped from dead).
def _beat_many(p: str) -> str:
    """BEAT_MANY with its parameters as ``%(name)s`` (p="s") or binary ``%(name)b`` (p="b")."""
    return f"""
WITH locked AS (
    SELECT a.id, {phases.columns("a")} FROM agents_agent a
    WHERE a.id = ANY(%(ids){p}::uuid[]) ORDER BY a.id FOR UPDATE SKIP LOCKED
)
UPDATE agents_agent a SET last_heartbeat = now(),
    metrics = CASE WHEN b.has_metrics THEN b.metrics ELSE a.metrics END,
    state = CASE WHEN b.draining AND a.state = 'live' THEN 'draining' ELSE a.state END
FROM unnest(%(ids){p}::uuid[], %(tenants){p}::bigint[], %(has){p}::bool[], %(metrics){p}::jsonb[],
            %(draining){p}::bool[]) AS b(id, tenant_id, has_metrics, metrics, draining), locked
WHERE a.id = b.id AND locked.id = a.id AND a.tenant_id = b.tenant_id
  AND a.state IN ('live', 'draining')
RETURNING a.id, a.state, a.drain_requested_at IS NOT NULL, {phases.before("locked")}
"""


BEAT_MANY = _beat_many("s")
# The same with binary parameters, for the socket writer's own (async, server-side binding)
# connection: a round carries thousands of beats, and the text format escapes every array
# element with a regular expression (~18 µs a beat, against ~2.5 µs in binary).
BEAT_MANY_BINARY = _beat_many("b")

# Of the beats BEAT_MANY did not write, those of agents that still beat (live or draining, of
# the tenant the socket belongs to): their rows were locked, so they are tried again; the
# others are dead or unknown, and their sockets close.  No lock taken.
BEAT_PENDING = """
SELECT a.id FROM agents_agent a
JOIN unnest(%(ids)s::uuid[], %(tenants)s::bigint[]) AS b(id, tenant_id)
  ON a.id = b.id AND a.tenant_id = b.tenant_id
WHERE a.state IN ('live', 'draining')
"""

_CONNECT = f"""
WITH old AS (
    SELECT a.id, {phases.columns("a")} FROM agents_agent a
    WHERE a.id = %(agent)s AND a.tenant_id = %(tenant)s AND a.state IN ('live', 'draining')
    FOR UPDATE
)
UPDATE agents_agent a SET connected_to = %(server)s,
    connection_generation = a.connection_generation + 1, last_heartbeat = now()
FROM old WHERE a.id = old.id
RETURNING a.tenant_id, a.name, a.wire_format, a.connection_generation, {phases.before("old")}
"""

_DISCONNECT = """
UPDATE agents_agent SET connected_to = ''
WHERE id = %s AND connected_to = %s AND connection_generation = %s
RETURNING state, connection_generation, in_flight, max_concurrency
"""


def beat(
    tenant_id: int, agent_id: uuid.UUID, metrics_json: str | None, draining: bool
) -> tuple[str, bool] | None:
    """Record a beat (``metrics_json``: None keeps the stored metrics; ``draining``: the
    agent drains on its own); (state, drain requested) or None when unknown or dead."""
    with connection.cursor() as cursor:
        cursor.execute(
            _BEAT,
            {
                "agent": agent_id,
                "tenant": tenant_id,
                "has": metrics_json is not None,
                "metrics": metrics_json or "{}",
                "draining": draining,
            },
        )
        row = cursor.fetchone()
    if row is None:
        return None
    count_beats([(agent_id, *row)])
    return (row[0], row[1])


def count_beats(rows: list[tuple]) -> None:
    """Count the phase transitions of beats (:data:`BEAT_MANY`'s rows: id, state, drain
    requested, then the row's phase before): an agent may declare itself draining."""
    for row in rows:
        if row[1] == AgentState.DRAINING:
            _moved_from(row[3:], Phase.DRAINING)


def connect(agent_id: uuid.UUID, tenant_id: int, server: str) -> tuple[int, str, str, int] | None:
    """``server`` now holds the agent's socket: bumps ``connection_generation`` (whichever
    connection came last owns the agent).  (tenant_id, name, wire_format, generation),
    or None when the agent is unknown in the tenant or dead."""
    with connection.cursor() as cursor:
        cursor.execute(_CONNECT, {"server": server, "agent": agent_id, "tenant": tenant_id})
        row = cursor.fetchone()
    if row is None:
        return None
    state, _connected, generation, in_flight, slots = row[4:]
    _moved_from(row[4:], phases.of(state, True, generation, in_flight, slots))
    return row[:4]


def disconnect(agent_id: uuid.UUID, server: str, generation: int) -> bool:
    """Forget the socket, unless a newer connection (here or elsewhere) already owns the agent."""
    with connection.cursor() as cursor:
        cursor.execute(_DISCONNECT, [agent_id, server, generation])
        row = cursor.fetchone()
    if row is None:
        return False
    state, gen, in_flight, slots = row
    _moved(phases.of(state, True, gen, in_flight, slots), phases.of(state, False, gen, 0, slots))
    return True


# -- drain -----------------------------------------------------------------------------


class DrainRefused(DomainError):
    """The agent cannot be drained (``kind``: invalid timeout or a dead agent)."""


@dataclass(frozen=True)
class Drain:
    agent_id: uuid.UUID
    name: str
    state: str
    in_flight: int
    drain_deadline: datetime | None


_DRAIN = f"""
WITH old AS (
    SELECT a.id, {phases.columns("a")} FROM agents_agent a
    WHERE a.id = %(agent)s AND a.state IN ('live', 'draining') FOR UPDATE
)
UPDATE agents_agent a SET state = 'draining',
    drain_requested_at = coalesce(a.drain_requested_at, now()),
    drain_deadline = LEAST(coalesce(a.drain_deadline, %(deadline)s), %(deadline)s)
FROM old WHERE a.id = old.id
RETURNING a.id, a.name, a.state, a.in_flight, a.drain_deadline, {phases.before("old")}
"""


def request_drain(agent_id: uuid.UUID, timeout_s: float, actor: str) -> Drain:
    """Mark the agent draining with a deadline ``timeout_s`` from now (an earlier one
    already set is kept) and clear its bindings; 409 for a dead agent.  Its next beat
    is answered with the ``drain`` frame (docs/agent.md); an agent still not gone at
    the deadline is evicted by the sweep.  Tenant checks are the caller's."""
    if not 0 < timeout_s <= MAX_DRAIN_TIMEOUT_S:
        raise DrainRefused(
            ErrorKind.INVALID, f"timeout_s must be in (0, {MAX_DRAIN_TIMEOUT_S:g}], got {timeout_s}"
        )
    deadline = timezone.now() + timedelta(seconds=timeout_s)
    with connection.cursor() as cursor:
        cursor.execute(_DRAIN, {"agent": agent_id, "deadline": deadline})
        row = cursor.fetchone()
    if row is None:
        name = Agent.objects.filter(pk=agent_id).values_list("name", flat=True).first()
        raise DrainRefused(
            ErrorKind.CONFLICT, f"agent {name or agent_id} is dead: there is nothing to drain"
        )
    drain = Drain(*row[:5])
    _moved_from(row[5:], Phase.DRAINING)
    affinity.clear_agent(agent_id)  # bound work binds afresh, to an agent that stays
    log.info(
        "agent %s drained by %s: %d task(s) in flight, deadline %s",
        drain.name, actor, drain.in_flight, drain.drain_deadline.isoformat(),
    )  # fmt: skip
    return drain


def drain_agents_of_key(key_lookup: str, timeout_s: float, actor: str) -> list[Drain]:
    """Drain the live agents registered with the key ``key_lookup`` (an actuator scaling
    down the agent it started with that key); one that died meanwhile is skipped."""
    live = Agent.objects.filter(api_key__lookup=key_lookup, state=AgentState.LIVE)
    drains = []
    for agent_id in live.values_list("id", flat=True):
        try:
            drains.append(request_drain(agent_id, timeout_s, actor))
        except DrainRefused:
            continue
    return drains


# -- evict -----------------------------------------------------------------------------

_DECLARE_ENDED = f"""
UPDATE agents_agent SET state = %s, dead_at = %s, connected_to = '', {ledger.SLOTS_CLEARED}
WHERE id = %s
"""


def liveness_reason(interval_s: float, misses: int) -> str:
    return f"no heartbeat for {interval_s * misses:g}s ({misses} missed beats of {interval_s:g}s)"


def evict_agent(
    agent_id: uuid.UUID,
    reason: str,
    stale_before: datetime | None = None,
    record: bool = True,
    ended: AgentState = AgentState.DEAD,
) -> Eviction | None:
    """Declare the agent dead (once), record the eviction and reclaim its work.

    ``stale_before``: only if its last heartbeat is still older than this (it may
    have beaten since the sweep looked).  ``record=False`` with ``ended=STOPPED`` is a
    clean exit (deregistration): no eviction is written unless work had to be moved.
    Returns the eviction, or None if the agent had already ended (or beat again).
    """
    with transaction.atomic():
        query = Agent.objects.select_for_update().filter(pk=agent_id, state__in=ACTIVE_STATES)
        if stale_before is not None:
            query = query.filter(last_heartbeat__lt=stale_before)
        agent = query.first()
        if agent is None:
            return None
        in_flight = agent.outbox_rows.filter(state__in=ledger.OPEN_STATES).count()
        with connection.cursor() as cursor:
            cursor.execute(_DECLARE_ENDED, [ended, timezone.now(), agent_id])
        affinity.clear_agent(agent_id)  # its bound work binds afresh (reclaim included)
        eviction = None
        if record or in_flight:
            eviction = Eviction.objects.create(
                agent=agent,
                tenant_id=agent.tenant_id,
                agent_name=agent.name,
                last_heartbeat=agent.last_heartbeat,
                in_flight=in_flight,
                reason=reason[:300],
            )
    _moved(
        phases.of(
            agent.state, agent.connected_to != "", agent.connection_generation,
            agent.in_flight, agent.max_concurrency,
        ),
        Phase(ended),
    )  # fmt: skip
    if eviction is not None:
        log.warning(
            "agent %s (%s) of tenant %s %s: %s; %d packet(s) in flight",
            agent.name, agent.id, agent.tenant_id,
            "declared dead" if ended == AgentState.DEAD else "stopped", reason, in_flight,
        )  # fmt: skip
    reclaim_in_flight(agent_id)
    return eviction


def sweep_dead_agents() -> list[Eviction]:
    """Evict agents past the liveness window (``heartbeat_interval_s × liveness_misses``
    without a beat; a compare-and-set, so several servers sweeping evict each once) and
    overdue drains, then retry reclaiming work left on dead agents and drop the group
    bindings of finished executions."""
    config = get_config()
    cutoff = timezone.now() - timedelta(seconds=config.liveness_window_s)
    stale = list(
        Agent.objects.filter(
            state__in=[AgentState.LIVE, AgentState.DRAINING], last_heartbeat__lt=cutoff
        ).values_list("id", flat=True)
    )
    reason = liveness_reason(config.heartbeat_interval_s, config.liveness_misses)
    evictions = [e for a in stale if (e := evict_agent(a, reason, stale_before=cutoff))]
    evictions += evict_overdue_drains()
    reclaim_orphaned_work()
    groups.prune_finished()
    return evictions


def evict_overdue_drains() -> list[Eviction]:
    """Evict draining agents past their drain deadline (:func:`request_drain` sets it);
    their unfinished work moves on."""
    overdue = Agent.objects.filter(
        state=AgentState.DRAINING, drain_deadline__lt=timezone.now()
    ).values_list("id", "in_flight")
    evictions = []
    for agent_id, in_flight in overdue:
        reason = f"drain deadline passed with {in_flight} task(s) still in flight"
        eviction = evict_agent(agent_id, reason)
        if eviction is not None:
            evictions.append(eviction)
    return evictions


def deregister(tenant_id: int, agent_id: uuid.UUID) -> bool:
    """A clean exit: the agent is stopped (not dead), no eviction is recorded (unless work
    had to be moved)."""
    if not Agent.objects.filter(pk=agent_id, tenant_id=tenant_id, state__in=ACTIVE_STATES).exists():
        return False
    evict_agent(
        agent_id, "deregistered with work still in flight", record=False, ended=AgentState.STOPPED
    )
    return True


# -- retire (key revocation) -----------------------------------------------------------


def revoke_key(key: ApiKey) -> bool:
    """Revoke ``key`` (once; False if it already was).  Its agents are declared dead at
    once and their work moves on: a delivery socket opened with the key must not
    outlive it."""
    revoked = (
        ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
        == 1
    )
    if revoked:
        key_cache.forget_key(key.pk)  # refused at once in this process, not after the TTL
        retire_agents_of_key(key.pk)
    return revoked


def revoke_keys(lookups: Iterable[str]) -> int:
    """Revoke keys by their public lookup part (already revoked or deleted ones are
    skipped) and retire their agents, as :func:`revoke_key`; returns how many were revoked."""
    ids = list(
        ApiKey.objects.filter(lookup__in=list(lookups), revoked_at__isnull=True).values_list(
            "id", flat=True
        )
    )
    revoked = 0
    for key_id in ids:
        now = timezone.now()
        if ApiKey.objects.filter(pk=key_id, revoked_at__isnull=True).update(revoked_at=now):
            revoked += 1
            key_cache.forget_key(key_id)
            retire_agents_of_key(key_id)
    return revoked


def retire_agents_of_key(key_id: int) -> int:
    """Declare dead every agent registered with a (just revoked) key and reclaim its work;
    their sockets close at the next beat (4404) and re-registering is refused (401)."""
    retired = 0
    ids = Agent.objects.filter(api_key_id=key_id, state__in=ACTIVE_STATES)
    for agent_id in ids.values_list("id", flat=True):
        if evict_agent(agent_id, "its API key was revoked") is not None:
            retired += 1
    return retired
