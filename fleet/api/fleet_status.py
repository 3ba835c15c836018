"""Fleet REST API: the tenant's fleet, self-service provisioning and the admin override.

A tenant key sees and changes only its own tenant's fleet, and only within
its effective limit; only a platform admin key can move the limit itself.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Literal

from django.http import HttpRequest
from django.utils import timezone
from ninja import Field, Query, Router, Schema
from ninja.errors import HttpError
from pydantic import BaseModel, ConfigDict

from agents.models import ENDED_STATES, Agent
from fleet.api import agent_list
from fleet.api.contract import optional_body, optional_body_doc
from fleet.control import limits
from fleet.executors.fleet.routing import health, phases
from fleet.executors.fleet.state import breaker
from fleet.models import AutoscaleDecision, FleetChange, Tenant
from fleet.platform.auth import admin_auth, read_auth, write_auth
from fleet.platform.config import get_config

router = Router(tags=["fleet"])

RECENT_DEAD = timedelta(minutes=10)  # dead agents stay listed this long, then only in history
HISTORY_MAX = 200


class ErrorOut(Schema):
    detail: str


# A plain pydantic model, not a ninja Schema: the page's rows are dicts, and a Schema wraps
# each one in ninja's attribute getter before validating it (a tenth of the CPU of GET /fleet
# at 100 agents a page).  (A comment, not a docstring: that would become its OpenAPI text.)
class AgentOut(BaseModel):
    id: uuid.UUID = Field(description="the agent id (POST /agents/{id}/drain)")
    name: str
    state: str = Field(
        description="live, draining, dead (evicted) or stopped (a clean exit or deprovision)"
    )
    phase: str = Field(
        description="connecting, ready, busy, draining, disconnected (socket gone, inside the "
        "liveness window), stopped or dead (docs/fleet.md)"
    )
    breaker: str = Field(
        description="its circuit breaker: closed, open (no new work until breaker_open_until) "
        "or half_open (one probe task may be placed) (docs/fleet.md)"
    )
    breaker_open_until: datetime | None = Field(
        None, description="when an open breaker lets a probe through (null: closed)"
    )
    health: str = Field(
        description="healthy, degraded (late heartbeat, socket open: ranked last), "
        "unhealthy (no socket: never selected), draining, dead or stopped (docs/routing.md)"
    )
    tags: list[str]
    capabilities: list[str]
    exclusive: bool
    version: str
    target_triple: str
    max_concurrency: int
    in_flight: int
    last_heartbeat: datetime
    managed_by: str = Field(description="the actuator that started it, or empty")


class FleetOut(Schema):
    tenant: str
    desired_count: int
    effective_limit: int
    max_agents_override: int | None
    overridden: bool
    utilization: float | None = Field(description="Σ in_flight / Σ max_concurrency of live agents")
    backlog: int = Field(description="Ready tasks waiting for an agent")
    outbox_open: int
    in_flight: int
    capacity: int
    agents_live: int = Field(description="live agents (all of them, whatever the filter)")
    agents_draining: int
    agents_total: int = Field(description="live and draining agents")
    agents_count: int = Field(
        description="agents matching the filter over all pages (``agents`` is one page of them)"
    )
    limit: int = Field(description="the page size asked for")
    offset: int
    next_offset: int | None = Field(description="the offset of the next page; null on the last")
    agents: list[AgentOut] = Field(
        description="one page of agents (``limit`` from ``offset``) matching the filter, "
        "in the ``sort`` order"
    )


class FleetQuery(Schema):
    state: Literal[agent_list.STATES] | None = Field(default=None, description="only this state")
    health: Literal[agent_list.HEALTHS] | None = Field(
        default=None, description="only this health class (docs/routing.md)"
    )
    tag: str | None = Field(
        default=None,
        max_length=agent_list.TAG_MAX_CHARS,
        pattern=agent_list.LABEL_PATTERN,
        description="only agents with this tag",
    )
    pool: str | None = Field(
        default=None,
        max_length=24,
        pattern=agent_list.POOL_NAME_PATTERN,
        description="only this pool's agents (``default``: those without a pool tag); "
        "404 for a pool the tenant does not have",
    )
    sort: Literal[agent_list.SORTS] = Field(
        default="name", description="the order; a leading ``-`` reverses it (name breaks ties)"
    )
    limit: int = Field(default=agent_list.DEFAULT_LIMIT, ge=1, le=agent_list.LIMIT_MAX)
    offset: int = Field(default=0, ge=0, le=agent_list.OFFSET_MAX)

    def agent_filter(self) -> agent_list.AgentFilter:
        return agent_list.AgentFilter(
            self.state or "", self.health or "", self.tag or "", self.pool or "", self.sort
        )


def _count_schema(nullable: bool):
    """limits' own checks (and messages) as the schema publishes them."""

    def publish(schema: dict) -> None:
        schema.pop("anyOf", None)
        number = {"type": "integer", "minimum": 0, "maximum": limits.AGENTS_MAX}
        schema.update({"anyOf": [number, {"type": "null"}]} if nullable else number)

    return publish


REASON_FIELD = Field(
    default="",
    max_length=limits.REASON_MAX_CHARS,
    pattern=limits.REASON_PATTERN,
    description="why, in words (optional): stored with the change and shown in "
    "GET /fleet/history and the console's audit trail",
)


class ReasonIn(Schema):
    model_config = ConfigDict(extra="forbid")

    reason: str = REASON_FIELD


class AdminFleetIn(Schema):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"minProperties": 1})

    # strict: JSON true/false are not the numbers 1/0
    max_agents_override: int | None = Field(
        default=None,
        strict=True,
        description="the tenant's ceiling; null clears it (platform default)",
        json_schema_extra=_count_schema(nullable=True),
    )
    desired_count: int | None = Field(
        default=None,
        strict=True,
        description="set desired_count directly",
        json_schema_extra=_count_schema(nullable=False),
    )
    reason: str = REASON_FIELD


class AdminFleetOut(Schema):
    tenant: str
    desired_count: int
    effective_limit: int
    max_agents_override: int | None
    overridden: bool


class ChangeOut(Schema):
    at: datetime
    field: str
    old_value: int | None
    new_value: int | None
    reason: str = Field(description="the kind of change: manual, admin, autoscaler, clamp, seed")
    actor: str
    note: str = Field(
        description="why, in words: the reason the person gave, a clamp's cause, or both"
    )


class DecisionOut(Schema):
    at: datetime
    pool: str = Field(description="the agent pool it scaled (docs/control-plane.md)")
    decision: str
    utilization: float | None
    backlog: int
    old_desired: int
    new_desired: int
    reason: str


class HistoryFilter(Schema):
    limit: int = Field(default=50, ge=1, le=HISTORY_MAX, description="records of each kind")


class HistoryOut(Schema):
    changes: list[ChangeOut]
    decisions: list[DecisionOut]


ERRORS = {401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 409: ErrorOut, 422: ErrorOut}


def actor_of(request: HttpRequest) -> str:
    """Who made a change, for the audit trail: the key's role and public lookup."""
    key = request.api_key
    return f"{key.role} key {key.lookup}"


def agents_page(
    tenant: Tenant,
    wanted: agent_list.AgentFilter,
    limit: int = agent_list.DEFAULT_LIMIT,
    offset: int = 0,
) -> agent_list.AgentPage:
    """One page of the tenant's agents (the recently dead included), as the API shows them."""
    config, now = get_config(), timezone.now()
    rows = Agent.objects.filter(tenant=tenant).exclude(
        state__in=ENDED_STATES, dead_at__lt=now - RECENT_DEAD
    )
    rows = agent_list.filter_agents(rows, wanted.checked(tenant), now).values(
        "id",
        "name",
        "state",
        "target_triple",
        "max_concurrency",
        "in_flight",
        "last_heartbeat",
        "managed_by",
        "connected_to",
        "tags",
        "capabilities",
        "exclusive",
        "version",
        *PHASE_AND_BREAKER_FIELDS,
    )
    page = agent_list.page_of(rows, limit, offset)
    for agent in page.rows:
        add_phase_and_breaker(agent, now)
        agent["health"] = health.classify(
            agent["state"], agent.pop("connected_to"), agent["last_heartbeat"], now,
            config.heartbeat_interval_s, config.liveness_window_s,
        )  # fmt: skip
    return page


PHASE_AND_BREAKER_FIELDS = ("connection_generation", "breaker_open_until")


def add_phase_and_breaker(agent: dict, now: datetime) -> None:
    """An agent row's ``phase`` and ``breaker`` (derived: :mod:`~fleet.executors.fleet.routing.phases`,
    :mod:`~fleet.executors.fleet.state.breaker`); reads ``connected_to`` without removing it."""
    agent["phase"] = phases.of(
        agent["state"], bool(agent["connected_to"]), agent.pop("connection_generation"),
        agent["in_flight"], agent["max_concurrency"],
    )  # fmt: skip
    agent["breaker"] = breaker.state_of(agent["breaker_open_until"], now)


def fleet_view(
    tenant: Tenant,
    wanted: agent_list.AgentFilter | None = None,
    limit: int = agent_list.DEFAULT_LIMIT,
    offset: int = 0,
) -> dict:
    """The fleet numbers (always the whole tenant's) and one page of its agents."""
    page = agents_page(tenant, wanted or agent_list.AgentFilter(), limit, offset)
    return {
        **limits.fleet_snapshot(tenant),
        "agents": page.rows,
        "agents_count": page.total,
        "limit": page.limit,
        "offset": page.offset,
        "next_offset": page.next_offset,
    }


def reason_of(request: HttpRequest) -> str:
    """The optional ``{"reason": "..."}`` JSON body of provision / deprovision.

    These endpoints took no body before, so a request without one (or with a form body)
    still means "no reason" (:func:`fleet.api.contract.optional_body`); any other body must
    be exactly ``ReasonIn``.
    """
    body = optional_body(request, ReasonIn)
    return body.reason if body is not None else ""


# What OpenAPI shows for the body reason_of reads (it is not a ninja body parameter).
REASON_BODY = optional_body_doc(ReasonIn)


def _change(func, request: HttpRequest) -> dict:
    func(request.tenant, actor_of(request), reason_of(request))
    return fleet_view(request.tenant)


@router.get("/fleet", auth=read_auth, response={200: FleetOut, **ERRORS})
def get_fleet(request: HttpRequest, query: Query[FleetQuery]):
    """The tenant's desired_count, limit, utilization, backlog, outbox, and its agents a page
    at a time (``limit`` from ``offset``, default the first 100 by name), filtered by
    ``state``, ``health``, ``tag`` and ``pool`` and ordered by ``sort``."""
    return fleet_view(request.tenant, query.agent_filter(), query.limit, query.offset)


@router.post(
    "/fleet/provision",
    auth=write_auth,
    response={200: FleetOut, **ERRORS},
    openapi_extra=REASON_BODY,
)
def provision(request: HttpRequest):
    """desired_count + 1, within the effective limit (409 at the limit); optional ``reason``."""
    return _change(limits.provision, request)


@router.post(
    "/fleet/deprovision",
    auth=write_auth,
    response={200: FleetOut, **ERRORS},
    openapi_extra=REASON_BODY,
)
def deprovision(request: HttpRequest):
    """desired_count − 1, down to 0 (409 at 0); optional ``reason``."""
    return _change(limits.deprovision, request)


@router.get("/fleet/history", auth=read_auth, response={200: HistoryOut, **ERRORS})
def fleet_history(request: HttpRequest, filters: Query[HistoryFilter]):
    """Recent audit records of the tenant's fleet numbers and autoscaler decisions."""
    limit = filters.limit
    tenant = request.tenant
    return {
        "changes": list(FleetChange.objects.filter(tenant=tenant)[:limit]),
        "decisions": list(AutoscaleDecision.objects.filter(tenant=tenant)[:limit]),
    }


@router.put(
    "/admin/tenants/{tenant}/fleet", auth=admin_auth, response={200: AdminFleetOut, **ERRORS}
)
def admin_set_fleet(request: HttpRequest, tenant: str, payload: AdminFleetIn):
    """Set a tenant's ``max_agents_override`` (null clears it) and/or ``desired_count``,
    with an optional ``reason``; every change is audited."""
    target = Tenant.objects.filter(name=tenant).first()
    if target is None:
        raise HttpError(404, f"unknown tenant {tenant!r}")
    given = payload.model_fields_set - {"reason"}
    if not given:
        raise HttpError(422, "give max_agents_override and/or desired_count")
    kwargs = {name: getattr(payload, name) for name in given}
    updated = limits.set_tenant_limits(target, actor_of(request), payload.reason, **kwargs)
    return {
        "tenant": updated.name,
        "desired_count": updated.desired_count,
        "effective_limit": limits.effective_limit(updated),
        "max_agents_override": updated.max_agents_override,
        "overridden": updated.max_agents_override is not None,
    }
