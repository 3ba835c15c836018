"""Agent pools per tenant: create, change, delete, provision and deprovision one pool.

The numbers (:mod:`fleet.models.pools`): the tenant's ``desired_count`` is the total of
all its pools and stays within the effective limit (:mod:`fleet.control.limits`, the owner
of that bound); a named pool stores its own count; the ``default`` pool holds the rest.
So provisioning a named pool raises the tenant total and the pool together, in one
transaction that locks the tenant row first (the same row every desired_count writer
updates, so concurrent calls serialise on it and none is lost), and every change writes
``FleetChange`` rows: the tenant's ``desired_count`` and the pool's (``pool:<name>``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Count, Sum

from agents.models import Agent, AgentState
from fleet.control import limits
from fleet.control.actuators import settings
from fleet.executors.fleet import roster
from fleet.executors.fleet.routing.pool_match import pool_of_tags, tenant_pools
from fleet.models import DEFAULT_POOL, AgentPool, ChangeReason, Tenant
from fleet.models.pools import POOL_NAME_PATTERN, POOL_TAG_PREFIX
from fleet.platform.config import ConfigError, get_config
from fleet.platform.errors import ErrorKind

FleetLimitError = limits.FleetLimitError
# Kubernetes quantities, as `kubectl` writes them ("500m", "1.5", "512Mi", "2G"), more than
# zero and small enough for their columns; settings.cpu_millis / memory_bytes read them.
CPU_PATTERN = r"^(?:[1-9][0-9]{0,6}m|(?!0+(?:\.0+)?$)[0-9]{1,4}(?:\.[0-9]{1,3})?)$"
MEMORY_PATTERN = (
    r"^(?!0+(?:\.0+)?(?:Ki|Mi|Gi|Ti|k|M|G|T)?$)"
    r"(?:[0-9]{1,12}|[0-9]{1,6}(?:\.[0-9]{1,3})?(?:Ki|Mi|Gi|Ti|k|M|G|T))$"
)
QUANTITY_MAX_CHARS = 16  # the cpu / memory columns
# A tag or capability: what `runagent --tags a,b` can carry intact (no comma, no control
# character, nothing stripped at either end).  The API publishes it as the items' pattern.
LABEL_PATTERN = r"^[^,\s\x00-\x1f\x7f]([^,\x00-\x1f\x7f]*[^,\s\x00-\x1f\x7f])?$"
GPU_MAX = 16
POOLS_MAX = 32  # per tenant: far above any real use, below a runaway script
LABEL_FIELDS = ("tags", "capabilities", "max_concurrency", "cpu", "memory", "gpu")


def _invalid(message: str) -> FleetLimitError:
    return FleetLimitError(ErrorKind.INVALID, message)


def check_name(name: object) -> str:
    if not isinstance(name, str) or not re.fullmatch(POOL_NAME_PATTERN, name):
        raise _invalid(
            f"pool name must be 1..24 lowercase letters, digits or '-' (not at either end), "
            f"got {name!r}"
        )
    return name


def _check_list(field: str, values: object) -> list[str]:
    if not isinstance(values, list):
        raise _invalid(f"{field} must be a list of strings, got {values!r}")
    if len(values) > roster.MAX_LIST_ITEMS:
        raise _invalid(f"{field}: at most {roster.MAX_LIST_ITEMS} entries, got {len(values)}")
    for value in values:
        if not isinstance(value, str) or not value or len(value) > roster.MAX_ITEM_CHARS:
            raise _invalid(
                f"{field}: each entry must be a string of 1..{roster.MAX_ITEM_CHARS} characters"
            )
        if field == "tags" and value.startswith(POOL_TAG_PREFIX):
            raise _invalid(f"tags: {value!r} is reserved (pool membership is set by the pool)")
        # runagent takes them as one comma-separated argument and strips each entry.
        if not re.fullmatch(LABEL_PATTERN, value) or _unencodable(value):
            raise _invalid(
                f"{field}: {value!r} holds a comma, a control character or surrounding spaces"
            )
    return sorted(set(values))


def _unencodable(value: str) -> bool:
    """A lone surrogate: JSON can carry it, PostgreSQL cannot store it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _check_pattern(field: str, value: object, pattern: str, example: str) -> str:
    if value is None or value == "":
        return ""
    if (
        not isinstance(value, str)
        or len(value) > QUANTITY_MAX_CHARS
        or not re.fullmatch(pattern, value)
    ):
        raise _invalid(f"{field} must be a Kubernetes quantity like {example!r}, got {value!r}")
    return value


def _check_int(field: str, value: object, low: int, high: int, nullable: bool) -> int | None:
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _invalid(f"{field} must be an integer in {low}..{high}, got {value!r}")
    return value


def _readable(field: str, value: str, read: Callable[[str, str], int]) -> str:
    """``value`` if the actuators can read it (what the docker actuator converts), else 422."""
    if value:
        try:
            read(field, value)
        except ConfigError as exc:
            raise _invalid(str(exc)) from None
    return value


def check_labels(fields: dict[str, Any]) -> dict[str, Any]:
    """The pool label fields given, validated and normalised (a 422 names the bad one)."""
    unknown = sorted(set(fields) - set(LABEL_FIELDS))
    if unknown:
        raise _invalid(f"unknown pool field(s): {', '.join(unknown)}")
    checked: dict[str, Any] = {}
    for field, value in fields.items():
        if field in ("tags", "capabilities"):
            checked[field] = _check_list(field, value)
        elif field == "max_concurrency":
            checked[field] = _check_int(field, value, 1, roster.MAX_CONCURRENCY, nullable=True)
        elif field == "gpu":
            checked[field] = _check_int(field, value, 0, GPU_MAX, nullable=False)
        elif field == "cpu":
            checked[field] = _readable(
                field, _check_pattern(field, value, CPU_PATTERN, "500m"), settings.cpu_millis
            )
        else:
            checked[field] = _readable(
                field, _check_pattern(field, value, MEMORY_PATTERN, "2Gi"), settings.memory_bytes
            )
    return checked


# -- reading -------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolState:
    """One pool as the API and the console show it."""

    pool: AgentPool
    desired_count: int
    agents_live: int
    in_flight: int
    capacity: int

    @property
    def name(self) -> str:
        return self.pool.name


def ensure_default_pool(tenant: Tenant) -> AgentPool:
    """The tenant's default pool row (created with no labels if it is missing)."""
    pool, _ = AgentPool.objects.get_or_create(tenant=tenant, name=DEFAULT_POOL)
    return pool


def list_pools(tenant: Tenant, refresh: bool = True) -> list[PoolState]:
    """The tenant's pools (default first, then by creation) with their counts and agents.
    ``refresh``: re-read the tenant's desired_count (False: the caller just read the row)."""
    if refresh:
        tenant.refresh_from_db(fields=["desired_count"])
    pools = tenant_pools(tenant.pk)
    if pools[0].pk is None:  # no default pool row yet (tenant_pools made an unsaved one)
        pools[0] = ensure_default_pool(tenant)
    named = sum(p.desired_count for p in pools if not p.is_default)
    live: dict[str, list[int]] = {}
    # Grouped by tag set in SQL: a fleet of 1,000 agents has a handful of distinct tag
    # sets, and decoding each agent's tags in Python cost more than the whole query.
    for tags, agents, in_flight, slots in (
        Agent.objects.filter(tenant=tenant, state=AgentState.LIVE)
        .values_list("tags")
        .annotate(n=Count("id"), f=Sum("in_flight"), s=Sum("max_concurrency"))
        .order_by()
    ):
        row = live.setdefault(pool_of_tags(tags), [0, 0, 0])
        row[0], row[1], row[2] = row[0] + agents, row[1] + in_flight, row[2] + slots
    states = []
    for pool in pools:
        count = max(tenant.desired_count - named, 0) if pool.is_default else pool.desired_count
        agents, in_flight, capacity = live.get(pool.name, (0, 0, 0))
        states.append(PoolState(pool, count, agents, in_flight, capacity))
    return states


def get_pool(tenant: Tenant, name: str) -> AgentPool:
    """The tenant's pool ``name`` (404 otherwise: another tenant's pool is not found either)."""
    if name == DEFAULT_POOL:
        return ensure_default_pool(tenant)
    pool = AgentPool.objects.filter(tenant=tenant, name=name).first()
    if pool is None:
        raise FleetLimitError(ErrorKind.NOT_FOUND, f"unknown pool {name!r}")
    return pool


def pool_state(tenant: Tenant, name: str) -> PoolState:
    get_pool(tenant, name)
    return next(s for s in list_pools(tenant) if s.name == name)


# -- changing labels -----------------------------------------------------------------
def _note(what: str, reason: str) -> str:
    return "; ".join(filter(None, (what, reason)))


def create_pool(
    tenant: Tenant, actor: str, name: object, fields: dict[str, Any], reason: str = ""
) -> AgentPool:
    """A new named pool with desired_count 0 (409 when the name is taken); ``reason``, the
    person's words, goes into the audit row's note."""
    reason = limits.check_reason(reason)
    name = check_name(name)
    labels = check_labels(fields)
    ensure_default_pool(tenant)
    if name == DEFAULT_POOL or AgentPool.objects.filter(tenant=tenant, name=name).exists():
        raise FleetLimitError(ErrorKind.CONFLICT, f"pool {name!r} already exists")
    if AgentPool.objects.filter(tenant=tenant).count() >= POOLS_MAX:
        raise FleetLimitError(ErrorKind.CONFLICT, f"a tenant may have at most {POOLS_MAX} pools")
    try:
        with transaction.atomic():
            pool = AgentPool.objects.create(tenant=tenant, name=name, **labels)
            limits.record_change(
                tenant.pk, limits.pool_field(name), None, 0, ChangeReason.MANUAL, actor,
                note=_note("pool created", reason),
            )  # fmt: skip
    except IntegrityError:  # created concurrently under the same name
        raise FleetLimitError(ErrorKind.CONFLICT, f"pool {name!r} already exists") from None
    return pool


def update_pool(tenant: Tenant, name: str, fields: dict[str, Any]) -> AgentPool:
    """Change a pool's labels, max_concurrency or resources (agents started from now on
    get them; the actuators restart no running agent for it)."""
    pool = get_pool(tenant, name)
    labels = check_labels(fields)
    if not labels:
        raise _invalid(f"nothing to change: give any of {', '.join(LABEL_FIELDS)}")
    AgentPool.objects.filter(pk=pool.pk).update(**labels)
    pool.refresh_from_db()
    return pool


def delete_pool(tenant: Tenant, name: str, actor: str, reason: str = "") -> None:
    """Delete a named pool; its agents go with it (the tenant total drops by its count)."""
    reason = limits.check_reason(reason)
    if name == DEFAULT_POOL:
        raise FleetLimitError(ErrorKind.CONFLICT, "the default pool cannot be deleted")
    pool = get_pool(tenant, name)
    with transaction.atomic():
        Tenant.objects.select_for_update().filter(pk=tenant.pk).first()
        locked = AgentPool.objects.select_for_update().filter(pk=pool.pk).first()
        if locked is None:
            raise FleetLimitError(ErrorKind.NOT_FOUND, f"unknown pool {name!r}")
        count = locked.desired_count
        if count:
            limits.move_pool_count(
                tenant.pk, None, -count, actor, ChangeReason.MANUAL,
                _note(f"pool {name!r} deleted", reason),
            )  # fmt: skip
        limits.record_change(
            tenant.pk, limits.pool_field(name), count, None, ChangeReason.MANUAL, actor,
            note=_note("pool deleted", reason),
        )  # fmt: skip
        locked.delete()


# -- the numbers ---------------------------------------------------------------------
def _lock_active(tenant: Tenant) -> Tenant:
    current = Tenant.objects.select_for_update().filter(pk=tenant.pk).first()
    if current is None:
        raise FleetLimitError(ErrorKind.NOT_FOUND, "tenant does not exist")
    if not current.is_active:
        raise FleetLimitError(ErrorKind.CONFLICT, f"tenant {current.name!r} is disabled")
    return current


def step_pool(
    tenant: Tenant,
    name: str,
    delta: int,
    actor: str,
    kind: str = ChangeReason.MANUAL,
    expect: int | None = None,
    reason: str = "",
) -> int:
    """A pool's desired_count ± 1 within its bounds; returns the pool's new count.

    Up: the tenant total (all pools) must stay within the effective limit.  Down: the pool
    must have an agent to give up.  The default pool moves the tenant total alone
    (CONTRACT.md's provision/deprovision).  ``expect``: the pool's count the caller saw
    (the autoscaler's compare-and-set): a conflict when it moved meanwhile.  ``kind`` is the
    audit's reason (manual, autoscaler), ``reason`` the person's words (the audit's note).
    """
    if delta not in (1, -1):
        raise ValueError(f"a pool moves by one agent at a time, not {delta}")
    reason = limits.check_reason(reason)
    if name == DEFAULT_POOL and kind == ChangeReason.MANUAL and expect is None:
        # Exactly CONTRACT.md's /fleet/provision and /fleet/deprovision (their messages too).
        (limits.provision if delta > 0 else limits.deprovision)(tenant, actor, reason)
        return pool_state(tenant, DEFAULT_POOL).desired_count
    pool = get_pool(tenant, name)
    with transaction.atomic():
        current = _lock_active(tenant)
        named = (
            AgentPool.objects.filter(tenant_id=tenant.pk).aggregate(n=Sum("desired_count"))["n"]
            or 0
        )
        locked = AgentPool.objects.select_for_update().filter(pk=pool.pk).first()
        if locked is None:
            raise FleetLimitError(ErrorKind.NOT_FOUND, f"unknown pool {name!r}")
        count = current.desired_count - named if locked.is_default else locked.desired_count
        if expect is not None and count != expect:
            raise FleetLimitError(
                ErrorKind.CONFLICT, f"pool {name!r} desired_count moved ({expect} → {count})"
            )
        limit = current.effective_limit(get_config().default_max_agents)
        if delta > 0 and current.desired_count >= limit:
            raise FleetLimitError(
                ErrorKind.CONFLICT,
                f"the tenant's pools already hold its effective limit ({limit} agents); "
                f"deprovision another pool first, or ask a platform admin to raise the limit",
            )
        if delta < 0 and count <= 0:
            raise FleetLimitError(
                ErrorKind.CONFLICT,
                f"pool {name!r} desired_count is already 0; there is nothing to deprovision",
            )
        limits.move_pool_count(
            tenant.pk, None if locked.is_default else locked.pk, delta, actor, kind, reason
        )
        tenant.desired_count = current.desired_count + delta
        return count + delta


def provision_pool(tenant: Tenant, name: str, actor: str, reason: str = "") -> int:
    return step_pool(tenant, name, +1, actor, reason=reason)


def deprovision_pool(tenant: Tenant, name: str, actor: str, reason: str = "") -> int:
    return step_pool(tenant, name, -1, actor, reason=reason)
