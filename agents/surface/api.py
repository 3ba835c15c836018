"""The agents' REST endpoints (docs/agent-protocol.md): register, heartbeat, results, deregister.

Every call needs an ``agent`` key; an agent id of another tenant is answered
exactly like an unknown one (404).  The result endpoint hands the outcome to
the one TaskResultHandler, after checking that the packet it names was
addressed to this agent of this tenant.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from django.http import HttpRequest, HttpResponse
from ninja import Field, Router, Schema, Status
from ninja.errors import HttpError
from ninja.security import HttpBearer

from agents.models import Agent
from agents.protocol.triples import MAX_TRIPLE_CHARS, TRIPLE_PATTERN
from fleet.executors.fleet import lifecycle, roster
from fleet.executors.fleet.delivery import context_ref
from fleet.executors.fleet.delivery import db as delivery_db
from fleet.executors.fleet.result_intake import UNKNOWN_AGENT, ResultIn, apply_result
from fleet.executors.fleet.routing.metrics import HEARTBEATS
from fleet.models import Role
from fleet.platform.auth import KeyAuth, agent_auth
from fleet.platform.config import get_config

router = Router()

# The sync endpoints an agent calls that the HTTP handler runs, middleware and all, on a
# thread of the delivery database pool (cloacina_site/one_hop.py): thousands of agents
# register or deregister at once in a storm or a deploy.  Not the REST beat: it is the
# liveness of an agent whose socket is down, and must not queue behind the pool's
# results and hellos when the server is busy.
POOLED_VIEWS = frozenset({"api-v1:register_agent", "api-v1:deregister_agent"})


class Error(Schema):
    detail: str


# Numbers and flags are strict: JSON true/false are not 1/0, and 0/1 are not flags.  The
# roster's own checks (with their clearer messages) are published in the schema as they are.
ROSTER_LIST = {
    "maxItems": roster.MAX_LIST_ITEMS,
    "items": {"type": "string", "minLength": 1, "maxLength": roster.MAX_ITEM_CHARS},
}


class RegisterIn(Schema):
    name: str = Field("", max_length=200)
    target_triple: str = Field(
        ..., max_length=MAX_TRIPLE_CHARS, json_schema_extra={"pattern": TRIPLE_PATTERN}
    )
    max_concurrency: int = Field(
        1, strict=True, json_schema_extra={"minimum": 1, "maximum": roster.MAX_CONCURRENCY}
    )
    version: str = Field("", max_length=50)
    protocol_version: int = Field(..., strict=True)
    wire_format: str = "json"
    tags: list[str] = Field([], json_schema_extra=ROSTER_LIST)
    capabilities: list[str] = Field([], json_schema_extra=ROSTER_LIST)
    exclusive: bool = Field(False, strict=True)
    metrics: dict[str, Any] = {}
    instance_id: uuid.UUID | None = Field(
        None,
        description="the agent process's own id, the same across its re-registrations: an "
        "outcome it reports under an earlier agent id counts for its current one",
    )


class RegisterOut(Schema):
    agent_id: uuid.UUID
    name: str
    heartbeat_interval_s: float
    liveness_misses: int
    wire_format: str
    ws_path: str
    server_protocol_version: int
    # This server answers ``result`` frames on the delivery socket (docs/agent-protocol.md).
    result_frames: bool
    # This server takes ``log`` frames (a running task's new output) on the socket.
    log_frames: bool = False
    # This server takes ``batch`` frames (several ``received``/``result`` frames in one).
    batch_frames: bool = False


class HeartbeatIn(Schema):
    in_flight: int = Field(0, ge=0, strict=True)
    running: list[uuid.UUID] = Field([], max_length=4096)
    metrics: dict[str, Any] = {}
    draining: bool = Field(False, strict=True)


class HeartbeatOut(Schema):
    state: str
    drain: bool


class ResultOut(Schema):
    applied: bool
    reason: str


class Empty(Schema):
    pass


@router.post(
    "/agents/register",
    auth=agent_auth,
    response={201: RegisterOut, 409: Error, 422: Error, 429: Error},
    summary="Register an agent (replaces a live agent of the same name)",
)
def register_agent(request: HttpRequest, body: RegisterIn):
    agent = roster.register(request.api_key, as_registration(body))
    return Status(201, roster.registration_answer(agent))


def as_registration(body: RegisterIn) -> roster.Registration:
    """The roster's registration from a checked body (REST, or a ``register`` frame)."""
    return roster.Registration(
        name=body.name,
        target_triple=body.target_triple,
        max_concurrency=body.max_concurrency,
        version=body.version,
        protocol_version=body.protocol_version,
        wire_format=body.wire_format,
        tags=tuple(body.tags),
        capabilities=tuple(body.capabilities),
        exclusive=body.exclusive,
        metrics=body.metrics,
        instance_id=body.instance_id,
    )


@router.post(
    "/agents/{agent_id}/heartbeat",
    auth=agent_auth,
    response={200: HeartbeatOut, 404: Error, 422: Error},
    summary="Heartbeat over REST (the socket carries them too)",
)
def agent_heartbeat(request: HttpRequest, agent_id: uuid.UUID, body: HeartbeatIn):
    metrics = roster.check_metrics(body.metrics) if body.metrics else None
    HEARTBEATS.labels(via="rest").inc()
    beat = roster.heartbeat(request.tenant.pk, agent_id, body.running, metrics, body.draining)
    if beat is None:
        return Status(404, {"detail": UNKNOWN_AGENT})
    return Status(200, {"state": beat.state, "drain": beat.drain})


class PooledAgentAuth(HttpBearer):
    """``agent_auth`` for the hottest endpoint, checked on the delivery DB pool.

    A sync auth callback runs in a new thread per request with a new database
    connection; every agent reports every result, so this one reuses the pool's
    connections instead.  The checks themselves are ``agent_auth``'s.
    """

    roles = agent_auth.roles  # published as the operation's x-roles

    async def __call__(self, request: HttpRequest):
        header = request.headers.get("Authorization", "")
        if not header:
            raise HttpError(401, "missing Authorization: Bearer <key> header")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            return None
        return await delivery_db.call(agent_auth.authenticate, request, token.strip())

    def authenticate(self, request: HttpRequest, token: str):  # pragma: no cover - see __call__
        return agent_auth.authenticate(request, token)


pooled_agent_auth = PooledAgentAuth()


@router.post(
    "/agents/{agent_id}/results",
    auth=pooled_agent_auth,
    response={200: ResultOut, 404: Error},
    summary="Report a task outcome (idempotent: a duplicate or late one is recorded, not applied)",
)
async def agent_result(request: HttpRequest, agent_id: uuid.UUID, body: ResultIn):
    status, answer = await delivery_db.call(apply_result, request.tenant.pk, agent_id, body)
    return Status(status, answer)


@router.post(
    "/agents/{agent_id}/deregister",
    auth=agent_auth,
    response={200: Empty, 404: Error},
    summary="Leave the fleet cleanly (the agent is stopped, not dead; no eviction is recorded)",
)
def deregister_agent(request: HttpRequest, agent_id: uuid.UUID):
    if not lifecycle.deregister(request.tenant.pk, agent_id):
        return Status(404, {"detail": UNKNOWN_AGENT})
    return Status(200, {})


# -- routing: drain on request, large contexts by reference (docs/routing.md) -----------

# The agent's own tenant's write key only. The platform-wide admin key may change a
# tenant's fleet numbers (PUT /admin/tenants/{tenant}/fleet, audited, and the control plane
# then drains agents itself) but not reach into a fleet agent by agent (docs/threat-model.md).
drain_auth = KeyAuth(Role.WRITE)


class DrainIn(Schema):
    timeout_s: float | None = Field(
        None,
        gt=0,
        le=lifecycle.MAX_DRAIN_TIMEOUT_S,
        description="seconds the agent gets to finish its in-flight work before it is "
        "evicted and the work moves on (default CLOACINA_AGENT_DRAIN_TIMEOUT_S)",
    )


class DrainOut(Schema):
    agent_id: uuid.UUID
    name: str
    state: str
    in_flight: int
    drain_deadline: datetime


@router.post(
    "/agents/{agent_id}/drain",
    auth=drain_auth,
    response={200: DrainOut, 404: Error, 409: Error, 422: Error},
    summary="Drain an agent: no new work, in-flight work finishes, then it exits",
)
def drain_agent(request: HttpRequest, agent_id: uuid.UUID, body: DrainIn | None = None):
    if not Agent.objects.filter(pk=agent_id, tenant=request.tenant).exists():
        return Status(404, {"detail": UNKNOWN_AGENT})
    timeout_s = (body.timeout_s if body else None) or get_config().agent_drain_timeout_s
    done = lifecycle.request_drain(agent_id, timeout_s, f"api:{request.api_key.lookup}")
    return Status(200, done.__dict__)


@router.get(
    "/agents/{agent_id}/tasks/{task_execution_id}/context",
    auth=agent_auth,
    response={200: dict[str, Any], 404: Error, 413: Error},
    summary="The input context of a work packet that carries context_ref (too large for a frame)",
)
def task_context(
    request: HttpRequest, agent_id: uuid.UUID, task_execution_id: uuid.UUID, assignment: int
):
    status, text = context_ref.serve_context(
        request.tenant.pk, agent_id, task_execution_id, assignment
    )
    if status != 200:
        return Status(status, {"detail": text})
    # The exact text the packet was sized for (the agent checks its sha256).
    return HttpResponse(text, content_type="application/json; charset=utf-8")
