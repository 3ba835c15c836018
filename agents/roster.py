"""The agent roster's services: register (and replace), heartbeat, deregister, sockets.

Every function takes the caller's tenant and refuses agents of any other
tenant exactly as it refuses unknown ones (None), so a key of tenant A can
never tell whether an agent id of tenant B exists.  State changes are
compare-and-set updates; dead is final (a dead agent registers anew).
"""

from __future__ import annotations

import json
import secrets
import uuid
from dataclasses import dataclass
from datetime import timedelta

from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from agents.models import Agent, AgentState
from agents.protocol.triples import TripleError, parse_triple
from agents.protocol.wire import WireFormatError, require_same_format
from cloacina_site.auth import ROLE_IMPLIES, touch_last_used
from cloacina_site.config import get_config
from fleet.delivery.liveness import evict_agent
from fleet.delivery.redelivery import mark_running_received
from fleet.engine.context import unstorable
from fleet.errors import DomainError, ErrorKind
from fleet.models import ApiKey, Role, Tenant

PROTOCOL_VERSION = 1
# The protocol versions this server can talk.  During a rolling upgrade a server that
# already speaks a new version keeps the old one here until the last old agent is gone.
SUPPORTED_PROTOCOL_VERSIONS = (PROTOCOL_VERSION,)
MAX_CONCURRENCY = 1024
MAX_LIST_ITEMS = 64
MAX_ITEM_CHARS = 100
MAX_METRICS_BYTES = 16 * 1024
REGISTER_ATTEMPTS = 3  # a concurrent registration of the same name may win the unique index
# Registration is bounded, so a runaway or hostile agent key cannot fill the roster: live
# agents per tenant (a same-name registration replaces one and is always let through) and
# registrations per key per minute (each one leaves a row behind, dead ones as history).
MIN_LIVE_AGENTS_CAP = 64
LIVE_AGENTS_PER_LIMIT = 4  # the cap is max(MIN_LIVE_AGENTS_CAP, 4 × effective limit)
REGISTRATIONS_PER_KEY_PER_MINUTE = 60
ROSTER_LOCK_CLASS = 0x524F5354  # pg_advisory_xact_lock(class, tenant id) around the cap check


class RosterError(DomainError):
    """A request the roster refuses; ``kind`` says what kind of refusal, the message says why."""


@dataclass(frozen=True)
class Registration:
    name: str
    target_triple: str
    max_concurrency: int = 1
    version: str = ""
    protocol_version: int = PROTOCOL_VERSION
    wire_format: str = "json"
    tags: tuple[str, ...] = ()
    capabilities: tuple[str, ...] = ()
    exclusive: bool = False
    metrics: dict | None = None
    # The agent process's id: the same across its re-registrations (agents/result_intake.py).
    instance_id: uuid.UUID | None = None


def _check_strings(field: str, values) -> list[str]:
    values = list(values or [])
    if len(values) > MAX_LIST_ITEMS:
        raise RosterError(
            ErrorKind.INVALID, f"{field}: at most {MAX_LIST_ITEMS} entries, got {len(values)}"
        )
    for value in values:
        if not isinstance(value, str) or not value or len(value) > MAX_ITEM_CHARS:
            raise RosterError(
                ErrorKind.INVALID,
                f"{field}: each entry must be a string of 1..{MAX_ITEM_CHARS} characters",
            )
    return values


def check_metrics(metrics) -> dict:
    """``metrics`` if it is an object jsonb can store within the size limit, else a 422."""
    metrics = metrics or {}
    if not isinstance(metrics, dict):
        raise RosterError(ErrorKind.INVALID, "metrics must be a JSON object")
    try:  # jsonb refuses NaN and Infinity: a 500 at the UPDATE otherwise
        size = len(json.dumps(metrics, default=str, allow_nan=False))
    except ValueError:
        raise RosterError(
            ErrorKind.INVALID, "metrics must hold finite numbers only (no NaN or Infinity)"
        ) from None
    problem = unstorable(metrics)
    if problem:
        raise RosterError(ErrorKind.INVALID, f"metrics hold {problem}")
    if size > MAX_METRICS_BYTES:
        raise RosterError(
            ErrorKind.INVALID, f"metrics is {size} bytes, over the {MAX_METRICS_BYTES}-byte limit"
        )
    return metrics


def protocol_refusal(agent_protocol: int, agent_version: str = "") -> str:
    """The 409 message for an agent whose protocol this server does not speak: both versions."""
    supported = " and ".join(str(v) for v in SUPPORTED_PROTOCOL_VERSIONS)
    software = f" (agent software {agent_version[:50]})" if agent_version else ""
    return (
        f"agent speaks protocol {agent_protocol}, this server supports {supported}{software}; "
        "upgrade the older side so both speak a common protocol version"
    )


def _validate(reg: Registration) -> Registration:
    config = get_config()
    if reg.protocol_version not in SUPPORTED_PROTOCOL_VERSIONS:
        raise RosterError(ErrorKind.CONFLICT, protocol_refusal(reg.protocol_version, reg.version))
    try:
        require_same_format(config.wire_format, reg.wire_format)
    except WireFormatError as exc:
        raise RosterError(
            ErrorKind.CONFLICT,
            f"{exc} (protocol version: agent {reg.protocol_version}, server {PROTOCOL_VERSION})",
        ) from None
    try:
        parse_triple(reg.target_triple)
    except TripleError as exc:
        raise RosterError(ErrorKind.INVALID, f"target_triple: {exc}") from None
    if not 1 <= reg.max_concurrency <= MAX_CONCURRENCY:
        raise RosterError(
            ErrorKind.INVALID,
            f"max_concurrency must be 1..{MAX_CONCURRENCY}, got {reg.max_concurrency}",
        )
    name = (reg.name or "").strip() or f"agent-{secrets.token_hex(4)}"
    if len(name) > 200:
        raise RosterError(ErrorKind.INVALID, "name must be at most 200 characters")
    return Registration(
        name=name,
        target_triple=reg.target_triple,
        max_concurrency=reg.max_concurrency,
        version=(reg.version or "")[:50],
        protocol_version=reg.protocol_version,
        wire_format=reg.wire_format,
        tags=tuple(_check_strings("tags", reg.tags)),
        capabilities=tuple(_check_strings("capabilities", reg.capabilities)),
        exclusive=bool(reg.exclusive),
        metrics=check_metrics(reg.metrics),
        instance_id=reg.instance_id,
    )


def _check_rate(key: ApiKey) -> None:
    """429 past the registration rate of ``key`` (checked before anyone is replaced)."""
    since = timezone.now() - timedelta(minutes=1)
    recent = Agent.objects.filter(api_key=key, registered_at__gt=since).count()
    if recent >= REGISTRATIONS_PER_KEY_PER_MINUTE:
        raise RosterError(
            ErrorKind.LIMITED,
            f"this key registered {recent} agents in the last minute (at most "
            f"{REGISTRATIONS_PER_KEY_PER_MINUTE}); an agent registers once and keeps its name",
        )


def _check_cap(key: ApiKey, name: str) -> None:
    """429 when the tenant already holds its cap of agents that are not dead, unless this
    registration replaces one of them (same name)."""
    live = Agent.objects.filter(tenant_id=key.tenant_id).exclude(state=AgentState.DEAD)
    cap = max(MIN_LIVE_AGENTS_CAP, LIVE_AGENTS_PER_LIMIT * key.tenant.effective_limit())
    if live.count() >= cap and not live.filter(name=name).exists():
        raise RosterError(
            ErrorKind.LIMITED,
            f"tenant {key.tenant.name!r} already has {cap} agents that are not dead (the cap is "
            f"max({MIN_LIVE_AGENTS_CAP}, {LIVE_AGENTS_PER_LIMIT} × its agent limit)); "
            "deregister some, or wait for silent ones to be evicted",
        )


def register(key: ApiKey, registration: Registration) -> Agent:
    """Add an agent to the key's tenant; a live agent of the same name is replaced
    (declared dead, its work reclaimed) — a restarted agent keeps its name."""
    reg = _validate(registration)
    _check_rate(key)
    _check_cap(key, reg.name)  # refuse before replacing anyone
    for _ in range(REGISTER_ATTEMPTS):
        try:
            with transaction.atomic():
                # Registrations of one tenant take turns here: both bounds are exact, and a
                # same-name agent is replaced only by a registration that is let in.
                with connection.cursor() as cursor:
                    cursor.execute(
                        "SELECT pg_advisory_xact_lock(%s, %s)", [ROSTER_LOCK_CLASS, key.tenant_id]
                    )
                _check_rate(key)
                _check_cap(key, reg.name)
                holder = (
                    Agent.objects.filter(tenant_id=key.tenant_id, name=reg.name)
                    .exclude(state=AgentState.DEAD)
                    .values_list("id", flat=True)
                    .first()
                )
                if holder is not None:
                    evict_agent(holder, "replaced by a new registration with the same name")
                return Agent.objects.create(
                    tenant_id=key.tenant_id,
                    api_key=key,
                    name=reg.name,
                    target_triple=reg.target_triple,
                    max_concurrency=reg.max_concurrency,
                    version=reg.version,
                    protocol_version=reg.protocol_version,
                    wire_format=reg.wire_format,
                    tags=list(reg.tags),
                    capabilities=list(reg.capabilities),
                    exclusive=reg.exclusive,
                    metrics=reg.metrics or {},
                    instance_id=reg.instance_id,
                )
        except IntegrityError:
            continue  # a concurrent registration took the name first: replace that one
    raise RosterError(
        ErrorKind.CONFLICT, f"agent name {reg.name!r} is being registered concurrently; retry"
    )


def revoke_key(key: ApiKey) -> bool:
    """Revoke ``key`` (once; False if it already was).  Its agents are declared dead at
    once and their work moves on: a delivery socket opened with the key must not
    outlive it."""
    revoked = (
        ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
        == 1
    )
    if revoked:
        retire_agents_of_key(key.pk)
    return revoked


def retire_agents_of_key(key_id: int) -> int:
    """Declare dead every agent registered with a (just revoked) key and reclaim its work;
    their sockets close at the next beat (4404) and re-registering is refused (401)."""
    retired = 0
    ids = Agent.objects.filter(api_key_id=key_id).exclude(state=AgentState.DEAD)
    for agent_id in ids.values_list("id", flat=True):
        if evict_agent(agent_id, "its API key was revoked") is not None:
            retired += 1
    return retired


def agent_of_tenant(tenant: Tenant | int, agent_id: uuid.UUID) -> Agent | None:
    """The agent (in any state) if it belongs to ``tenant``."""
    return Agent.objects.filter(pk=agent_id, tenant=tenant).first()


@dataclass(frozen=True)
class Beat:
    state: str
    drain: bool


def heartbeat(
    tenant_id: int,
    agent_id: uuid.UUID,
    running: list[uuid.UUID] | None = None,
    metrics: dict | None = None,
    draining: bool = False,
) -> Beat | None:
    """Record a beat; None when the agent is unknown here or already dead (it must re-register)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            UPDATE agents_agent SET last_heartbeat = now(),
                metrics = CASE WHEN %s THEN %s::jsonb ELSE metrics END,
                state = CASE WHEN %s AND state = 'live' THEN 'draining' ELSE state END
            WHERE id = %s AND tenant_id = %s AND state <> 'dead'
            RETURNING state, drain_requested_at IS NOT NULL
            """,
            [metrics is not None, json.dumps(metrics or {}), draining, agent_id, tenant_id],
        )
        row = cursor.fetchone()
    if row is None:
        return None
    if running:
        mark_running_received(agent_id, running)
    return Beat(state=row[0], drain=row[1])


def deregister(tenant_id: int, agent_id: uuid.UUID) -> bool:
    """A clean exit: the agent is dead, no eviction is recorded (unless work had to be moved)."""
    if not Agent.objects.filter(pk=agent_id, tenant_id=tenant_id).exclude(state="dead").exists():
        return False
    evict_agent(agent_id, "deregistered with work still in flight", record=False)
    return True


# -- the delivery socket -------------------------------------------------------------


@dataclass(frozen=True)
class SocketGrant:
    agent_id: uuid.UUID
    tenant_id: int
    name: str
    wire_format: str
    generation: int
    # The key the socket was opened with: the socket lives only as long as this key (and
    # its tenant) stays active, whichever key registered the agent.
    key_id: int | None = None


@dataclass(frozen=True)
class SocketRefusal:
    code: int
    reason: str


def open_socket(token: str, agent_id: uuid.UUID, server: str) -> SocketGrant | SocketRefusal:
    """Authenticate a delivery socket and record that ``server`` now holds it.

    Bumps ``connection_generation``: whichever connection came last owns the
    agent, and an older connection's disconnect can no longer clear it.
    """
    key = ApiKey.verify(token)
    if key is None:
        return SocketRefusal(4401, "invalid or revoked API key")
    if not (ROLE_IMPLIES[key.role] & {Role.AGENT}):
        return SocketRefusal(4403, f"a {key.role} key may not open an agent socket (needs agent)")
    touch_last_used(key)
    with connection.cursor() as cursor:
        cursor.execute(
            """
            UPDATE agents_agent SET connected_to = %s,
                connection_generation = connection_generation + 1, last_heartbeat = now()
            WHERE id = %s AND tenant_id = %s AND state <> 'dead'
            RETURNING tenant_id, name, wire_format, connection_generation
            """,
            [server, agent_id, key.tenant_id],
        )
        row = cursor.fetchone()
    if row is None:
        return SocketRefusal(4404, "unknown agent (never registered here, or dead): register again")
    return SocketGrant(agent_id, *row, key_id=key.pk)


def close_socket(agent_id: uuid.UUID, server: str, generation: int) -> bool:
    """Forget the socket, unless a newer connection (here or elsewhere) already owns the agent."""
    return (
        Agent.objects.filter(
            pk=agent_id, connected_to=server, connection_generation=generation
        ).update(connected_to="")
        == 1
    )
