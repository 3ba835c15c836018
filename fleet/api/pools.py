"""Agent pools REST: ``/api/v1/fleet/pools/...`` (docs/control-plane.md, "Agent pools").

A tenant key sees and changes only its own tenant's pools (another tenant's pool is a
404 like an unknown one); provisioning keeps the sum of the pools within the tenant's
effective limit (409 naming it), exactly like CONTRACT.md's ``/fleet/provision``.
"""

from __future__ import annotations

from typing import Annotated

from django.http import HttpRequest
from ninja import Field, Router, Schema
from ninja.responses import Status
from pydantic import BeforeValidator, ConfigDict

from fleet.api.fleet_status import ERRORS, REASON_BODY, REASON_FIELD, actor_of, reason_of
from fleet.control import pools
from fleet.executors.fleet import roster
from fleet.models.pools import POOL_NAME_PATTERN
from fleet.platform.auth import read_auth, write_auth

router = Router(tags=["fleet"])


def _labels(pattern: str) -> dict:
    """The published schema of a tags / capabilities list (the control plane checks it)."""
    return {
        "maxItems": roster.MAX_LIST_ITEMS,
        "items": {"type": "string", "minLength": 1, "maxLength": roster.MAX_ITEM_CHARS,
                  "pattern": pattern},
    }  # fmt: skip


def _quantity(pattern: str) -> dict:
    return {
        "anyOf": [
            {"type": "string", "maxLength": pools.QUANTITY_MAX_CHARS, "pattern": pattern},
            {"type": "string", "maxLength": 0},
            {"type": "null"},
        ]
    }


def _whole_number(value: object) -> object:
    """JSON has one number type: 2.0 is the integer 2 (JSON Schema agrees); true or "2" is not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


WholeNumber = Annotated[int, BeforeValidator(_whole_number)]


class PoolLabelsIn(Schema):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"minProperties": 1})

    tags: list[str] = Field(
        [],
        description="runagent --tags of its agents (pool:* is reserved)",
        json_schema_extra=_labels("^(?!pool:)" + pools.LABEL_PATTERN[1:]),
    )
    capabilities: list[str] = Field(
        [], description="runagent --capabilities", json_schema_extra=_labels(pools.LABEL_PATTERN)
    )
    max_concurrency: WholeNumber | None = Field(
        None,
        strict=True,
        description="slots per agent; null: CLOACINA_AGENT_MAX_CONCURRENCY",
        json_schema_extra={
            "anyOf": [
                {"type": "integer", "minimum": 1, "maximum": roster.MAX_CONCURRENCY},
                {"type": "null"},
            ]
        },
    )
    cpu: str | None = Field(
        None,
        description="CPU per agent (docker, kubernetes), e.g. 500m; empty or null: default",
        json_schema_extra=_quantity(pools.CPU_PATTERN),
    )
    memory: str | None = Field(
        None,
        description="memory per agent (docker, kubernetes), e.g. 2Gi; empty or null: default",
        json_schema_extra=_quantity(pools.MEMORY_PATTERN),
    )
    gpu: WholeNumber = Field(
        0,
        strict=True,
        description="GPUs per agent (docker, kubernetes)",
        json_schema_extra={"minimum": 0, "maximum": pools.GPU_MAX},
    )


class PoolCreateIn(PoolLabelsIn):
    name: str = Field(
        ..., description="unique in the tenant", json_schema_extra={"pattern": POOL_NAME_PATTERN}
    )
    reason: str = REASON_FIELD


class PoolOut(Schema):
    name: str
    default: bool = Field(description="the default pool: CONTRACT.md's provision acts on it")
    desired_count: int = Field(description="default pool: the tenant total minus named pools'")
    tags: list[str]
    capabilities: list[str]
    max_concurrency: int | None
    cpu: str
    memory: str
    gpu: int
    agents_live: int
    in_flight: int
    capacity: int


class PoolsOut(Schema):
    desired_count: int = Field(description="the tenant total (all pools)")
    pools: list[PoolOut]


def _out(state: pools.PoolState) -> dict:
    pool = state.pool
    return {
        "name": pool.name,
        "default": pool.is_default,
        "desired_count": state.desired_count,
        "tags": pool.tags,
        "capabilities": pool.capabilities,
        "max_concurrency": pool.max_concurrency,
        "cpu": pool.cpu,
        "memory": pool.memory,
        "gpu": pool.gpu,
        "agents_live": state.agents_live,
        "in_flight": state.in_flight,
        "capacity": state.capacity,
    }


def _given(body: PoolLabelsIn) -> dict:
    """The label fields the body names (an explicit null clears max_concurrency/cpu/memory)."""
    given = body.model_fields_set - {"name", "reason"}
    return {name: getattr(body, name) for name in given}


@router.get("/fleet/pools", auth=read_auth, response={200: PoolsOut, **ERRORS})
def list_pools(request: HttpRequest):
    """The tenant's pools: default first, then named pools by creation."""
    states = pools.list_pools(request.tenant)
    return {"desired_count": request.tenant.desired_count, "pools": [_out(s) for s in states]}


@router.post("/fleet/pools", auth=write_auth, response={201: PoolOut, **ERRORS})
def create_pool(request: HttpRequest, body: PoolCreateIn):
    """A new named pool with desired_count 0 (409 when the name is taken)."""
    pool = pools.create_pool(
        request.tenant, actor_of(request), body.name, _given(body), body.reason
    )
    return Status(201, _out(pools.pool_state(request.tenant, pool.name)))


@router.get("/fleet/pools/{pool}", auth=read_auth, response={200: PoolOut, **ERRORS})
def get_pool(request: HttpRequest, pool: str):
    return _out(pools.pool_state(request.tenant, pool))


@router.patch("/fleet/pools/{pool}", auth=write_auth, response={200: PoolOut, **ERRORS})
def update_pool(request: HttpRequest, pool: str, body: PoolLabelsIn):
    """Change labels, max_concurrency or resources; agents started from now on get them."""
    pools.update_pool(request.tenant, pool, _given(body))
    return _out(pools.pool_state(request.tenant, pool))


@router.delete(
    "/fleet/pools/{pool}",
    auth=write_auth,
    response={204: None, **ERRORS},
    openapi_extra=REASON_BODY,
)
def delete_pool(request: HttpRequest, pool: str):
    """Delete a named pool and stop its agents (409 for ``default``); optional ``reason``."""
    pools.delete_pool(request.tenant, pool, actor_of(request), reason_of(request))
    return Status(204, None)


@router.post(
    "/fleet/pools/{pool}/provision",
    auth=write_auth,
    response={200: PoolOut, **ERRORS},
    openapi_extra=REASON_BODY,
)
def provision_pool(request: HttpRequest, pool: str):
    """The pool's desired_count + 1, the tenant total within the effective limit (409);
    optional ``reason``."""
    pools.provision_pool(request.tenant, pool, actor_of(request), reason_of(request))
    return _out(pools.pool_state(request.tenant, pool))


@router.post(
    "/fleet/pools/{pool}/deprovision",
    auth=write_auth,
    response={200: PoolOut, **ERRORS},
    openapi_extra=REASON_BODY,
)
def deprovision_pool(request: HttpRequest, pool: str):
    """The pool's desired_count − 1, down to 0 (409 at 0); optional ``reason``."""
    pools.deprovision_pool(request.tenant, pool, actor_of(request), reason_of(request))
    return _out(pools.pool_state(request.tenant, pool))
