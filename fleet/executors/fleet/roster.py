"""The agent roster's services: what a registration, a beat or a socket must be, and who
may make one.

The checks live here (protocol and wire format, limits, the tenant's cap and the key's
rate, socket authentication); the transitions they lead to are the agent lifecycle's
(:mod:`fleet.executors.fleet.lifecycle`: register and replace, beat, connect, drain, evict, retire).
Every function takes the caller's tenant and refuses agents of any other tenant
exactly as it refuses unknown ones (None), so a key of tenant A can never tell whether
an agent id of tenant B exists.  Dead is final (a dead agent registers anew).
"""

from __future__ import annotations

import json
import secrets
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import QuerySet
from django.utils import timezone

from agents.models import Agent
from agents.protocol.triples import TripleError, parse_triple
from agents.protocol.wire import WireFormatError, require_same_format
from fleet.engine.context import unstorable
from fleet.executors.fleet import lifecycle
from fleet.executors.fleet.delivery import admission
from fleet.executors.fleet.delivery.redelivery import mark_running_received
from fleet.models import ApiKey, Role, Tenant
from fleet.platform.auth import ROLE_IMPLIES, touch_last_used
from fleet.platform.config import get_config
from fleet.platform.errors import DomainError, ErrorKind

PROTOCOL_VERSION = 1
# The protocol versions this server can talk.  During a rolling upgrade a server that
# already speaks a new version keeps the old one here until the last old agent is gone.
SUPPORTED_PROTOCOL_VERSIONS = (PROTOCOL_VERSION,)
MAX_CONCURRENCY = 1024
MAX_LIST_ITEMS = 64
MAX_ITEM_CHARS = 100
MAX_METRICS_BYTES = 16 * 1024
# Registration is bounded, so a runaway or hostile agent key cannot fill the roster: agents
# that are not dead per tenant (CLOACINA_MAX_REGISTERED_AGENTS; a same-name registration
# replaces one and is always let through), registrations per key and per tenant in any
# sliding minute (CLOACINA_AGENT_REGISTRATIONS_PER_KEY_PER_MINUTE / _PER_TENANT_PER_MINUTE:
# each one leaves a row behind, dead ones as history), and registrations + socket opens
# per second of this process (delivery/admission.py).  docs/scaling.md sizes them.
RATE_WINDOW = timedelta(minutes=1)
# The cap frees when an agent deregisters or is evicted, which nobody can predict: a hint
# that keeps refused agents from hammering the server, short enough to notice a free place.
CAP_RETRY_AFTER_S = 30.0


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
    # The agent process's id: the same across its re-registrations (fleet/executors/fleet/result_intake.py).
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


def registrations_per_key_per_minute() -> int:
    """CLOACINA_AGENT_REGISTRATIONS_PER_KEY_PER_MINUTE (0: unlimited)."""
    return get_config().registrations_per_key_per_minute


def _check_admission() -> None:
    """429 while this server process admits no more agents this second (a storm)."""
    wait_s = admission.agents().admit()
    if wait_s > 0:
        raise RosterError(
            ErrorKind.LIMITED,
            "this server admits at most "
            f"{get_config().agent_admissions_per_s:g} agent registrations and socket opens "
            "per second (CLOACINA_AGENT_ADMISSIONS_PER_S); retry after the Retry-After delay",
            retry_after_s=wait_s,
        )


@dataclass(frozen=True)
class RateLimits:
    """Registrations per sliding minute: ``per_key`` of one key, ``per_tenant`` of all of a
    tenant's keys (0: unlimited)."""

    per_key: int
    per_tenant: int

    @classmethod
    def configured(cls) -> RateLimits:
        config = get_config()
        return cls(
            config.registrations_per_key_per_minute, config.registrations_per_tenant_per_minute
        )


def _check_rate(
    key: ApiKey, counts: lifecycle.RosterCounts, limits: RateLimits, now: datetime
) -> None:
    """429 past the registration rate of ``key`` or of its tenant (``counts``: the roster
    under its lock, before anyone is replaced)."""
    per_key = limits.per_key
    if per_key > 0 and counts.key_recent >= per_key:
        window = Agent.objects.filter(api_key=key, registered_at__gt=now - RATE_WINDOW)
        raise RosterError(
            ErrorKind.LIMITED,
            f"this key registered {counts.key_recent} agents in the last minute (at most "
            f"{per_key}); an agent registers once and keeps its name "
            "(CLOACINA_AGENT_REGISTRATIONS_PER_KEY_PER_MINUTE)",
            retry_after_s=_rate_frees_in_s(window, counts.key_recent, per_key, now),
        )
    per_tenant = limits.per_tenant
    if per_tenant > 0 and counts.tenant_recent >= per_tenant:
        window = Agent.objects.filter(tenant_id=key.tenant_id, registered_at__gt=now - RATE_WINDOW)
        raise RosterError(
            ErrorKind.LIMITED,
            f"tenant {key.tenant.name!r} registered {counts.tenant_recent} agents in the last "
            f"minute (at most {per_tenant}: CLOACINA_AGENT_REGISTRATIONS_PER_TENANT_PER_MINUTE)",
            retry_after_s=_rate_frees_in_s(window, counts.tenant_recent, per_tenant, now),
        )


def _rate_frees_in_s(window: QuerySet[Agent], recent: int, limit: int, now: datetime) -> float:
    """Seconds until the window holds one registration fewer than ``limit``: when the
    registration that many places from the oldest ages out of it."""
    times = window.order_by("registered_at").values_list("registered_at", flat=True)
    ages_out = times[recent - limit] + RATE_WINDOW
    return max(0.0, (ages_out - now).total_seconds())


def registration_cap(tenant: Tenant) -> int:
    """The most agents that are not dead ``tenant`` may hold (CLOACINA_MAX_REGISTERED_AGENTS)."""
    config = get_config()
    return config.registered_agents_cap(tenant.effective_limit(config.default_max_agents))


def _check_cap(key: ApiKey, counts: lifecycle.RosterCounts) -> None:
    """429 when the tenant already holds its cap of agents that are not dead, unless this
    registration replaces one of them (same name)."""
    cap = registration_cap(key.tenant)
    if counts.active >= cap and counts.holder is None:
        raise RosterError(
            ErrorKind.LIMITED,
            f"tenant {key.tenant.name!r} already has {cap} agents that are not dead (the cap "
            f"set by CLOACINA_MAX_REGISTERED_AGENTS={get_config().max_registered_agents}); "
            "deregister some, or wait for silent ones to be evicted",
            retry_after_s=CAP_RETRY_AFTER_S,
        )


def register(key: ApiKey, registration: Registration, connected_to: str = "") -> Agent:
    """Add an agent to the key's tenant; a live agent of the same name is replaced
    (declared dead, its work reclaimed) — a restarted agent keeps its name.
    ``connected_to``: the server holding the socket it registers on (:func:`register_socket`).

    The request's own checks come first and cost no database work; the rate and the cap
    are checked once, under the tenant's roster lock, on the counts the lifecycle reads
    there in one statement (exact, and before anyone is replaced)."""
    reg = _validate(registration)
    _check_admission()  # first: a storm costs this process no database work per refusal
    now, limits = timezone.now(), RateLimits.configured()
    bounds = lifecycle.RegistrationBounds(
        key_id=key.pk,
        since=now - RATE_WINDOW,
        per_key=limits.per_key > 0,
        per_tenant=limits.per_tenant > 0,
    )

    def admit(counts: lifecycle.RosterCounts) -> None:
        _check_rate(key, counts, limits, now)
        _check_cap(key, counts)

    agent = lifecycle.register(
        key.tenant_id,
        reg.name,
        {
            "api_key": key,
            "target_triple": reg.target_triple,
            "max_concurrency": reg.max_concurrency,
            "version": reg.version,
            "protocol_version": reg.protocol_version,
            "wire_format": reg.wire_format,
            "tags": list(reg.tags),
            "capabilities": list(reg.capabilities),
            "exclusive": reg.exclusive,
            "metrics": reg.metrics or {},
            "instance_id": reg.instance_id,
        },
        bounds,
        admit,
        connected_to,
    )
    if agent is None:
        raise RosterError(
            ErrorKind.CONFLICT, f"agent name {reg.name!r} is being registered concurrently; retry"
        )
    return agent


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
    metrics_json = None if metrics is None else json.dumps(metrics)
    row = lifecycle.beat(tenant_id, agent_id, metrics_json, draining)
    if row is None:
        return None
    if running:
        mark_running_received(agent_id, running)
    return Beat(state=row[0], drain=row[1])


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
    # A registration refused for now (4013): when to try again.
    retry_after_s: float | None = None


def _agent_key(token: str, action: str) -> ApiKey | SocketRefusal:
    """The agent key ``token`` names (its use recorded), or the socket's refusal: 4401 for
    a key that is unknown or revoked, 4403 for one whose role may not ``action``."""
    key = ApiKey.verify(token)
    if key is None:
        return SocketRefusal(4401, "invalid or revoked API key")
    if not (ROLE_IMPLIES[key.role] & {Role.AGENT}):
        return SocketRefusal(4403, f"a {key.role} key may not {action} (needs agent)")
    touch_last_used(key)
    return key


def open_socket(token: str, agent_id: uuid.UUID, server: str) -> SocketGrant | SocketRefusal:
    """Authenticate a delivery socket and record that ``server`` now holds it.

    Bumps ``connection_generation``: whichever connection came last owns the
    agent, and an older connection's disconnect can no longer clear it.
    """
    key = _agent_key(token, "open an agent socket")
    if isinstance(key, SocketRefusal):
        return key
    row = lifecycle.connect(agent_id, key.tenant_id, server)
    if row is None:
        return SocketRefusal(4404, "unknown agent (never registered here, or dead): register again")
    return SocketGrant(agent_id, *row, key_id=key.pk)


# A refused registration on the socket closes it with 4000 + the REST status, except a
# refusal for now (429 over REST): 4013 with "retry after N s", as a busy server's socket.
REGISTRATION_CLOSE_CODES = {ErrorKind.CONFLICT: 4409, ErrorKind.INVALID: 4422}
CLOSE_TRY_LATER = 4013


def registration_answer(agent: Agent) -> dict:
    """What a registration is answered, over REST (201) or on the socket (``registered``)."""
    config = get_config()
    return {
        "agent_id": agent.id,
        "name": agent.name,
        "heartbeat_interval_s": config.heartbeat_interval_s,
        "liveness_misses": config.liveness_misses,
        "wire_format": agent.wire_format,
        "ws_path": f"/ws/agents/{agent.id}/",
        "server_protocol_version": PROTOCOL_VERSION,
        "result_frames": True,
        "log_frames": True,
        "batch_frames": True,
    }


def register_socket(
    token: str, registration: Registration, server: str
) -> tuple[SocketGrant, Agent] | SocketRefusal:
    """A registration made on the delivery socket (docs/agent-protocol.md, "Registering on
    the socket"): the key checked as the REST endpoint checks it, and :func:`register`
    with the new agent's socket held by ``server`` in the same row (what
    :func:`open_socket` records, generation 1), so one connection both registers and
    delivers.  A refusal is the REST one as a close code."""
    key = _agent_key(token, "register an agent")
    if isinstance(key, SocketRefusal):
        return key
    try:
        agent = register(key, registration, connected_to=server)
    except RosterError as exc:
        return registration_refusal(exc)
    grant = SocketGrant(
        agent.id, agent.tenant_id, agent.name, agent.wire_format, agent.connection_generation,
        key_id=key.pk,
    )  # fmt: skip
    return grant, agent


def registration_refusal(exc: RosterError) -> SocketRefusal:
    """The close code and reason of a registration the roster refused."""
    if exc.kind is ErrorKind.LIMITED:
        seconds = admission.retry_after_s(exc.retry_after_s or 1.0)
        return SocketRefusal(CLOSE_TRY_LATER, f"retry after {seconds} s: {exc}", seconds)
    return SocketRefusal(REGISTRATION_CLOSE_CODES.get(exc.kind, 4422), str(exc))


def close_socket(agent_id: uuid.UUID, server: str, generation: int) -> bool:
    """Forget the socket, unless a newer connection (here or elsewhere) already owns the agent."""
    return lifecycle.disconnect(agent_id, server, generation)
