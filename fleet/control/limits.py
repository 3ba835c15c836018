"""Capacity limits and desired_count: the numbers that bound a tenant's fleet.

* effective limit: the platform default (CLOACINA_DEFAULT_MAX_AGENTS) unless a
  platform admin set ``max_agents_override``.  A tenant can never raise it.
* desired_count: the operational target, in [0, effective limit].  Whatever lowers
  the limit (an override, a smaller CLOACINA_DEFAULT_MAX_AGENTS at restart, a tenant
  row edited by hand), :func:`clamp_to_limits` pulls desired_count down to it.

Every change is one atomic statement (compare-and-set in the UPDATE's WHERE),
so concurrent provision calls never lose an update, and every change writes a
:class:`~fleet.models.FleetChange` audit row in the same transaction.

This module is the one writer of a tenant's limits (``AUDITED_FIELDS``: desired_count,
max_agents_override, max_backlog, is_active, storage_quota_bytes) after its creation; the
autoscaler's own guarded step writes desired_count and audits through :func:`record_change`.
REST, the console and the Django admin all call :func:`provision` / :func:`deprovision` /
:func:`set_fleet_overrides` / :func:`set_tenant_limits`, each taking the person's free-text
``reason`` (at most ``REASON_MAX_CHARS``), which lands in the audit row's ``note``.
tests/unit/test_state_owners.py holds every other module to that.
"""

from __future__ import annotations

import enum
import logging
import unicodedata
from datetime import datetime

from django.db import connection, transaction
from django.db.models import Count, Q, QuerySet, Sum
from django.utils import timezone

from agents.models import ACTIVE_STATES, Agent, AgentState
from fleet.models import (
    ChangeReason,
    DeliveryOutbox,
    FleetChange,
    OutboxState,
    TaskExecution,
    TaskStatus,
    Tenant,
)
from fleet.models.control import AUDITED_FIELDS, NOTE_MAX_CHARS, REASON_MAX_CHARS
from fleet.platform.config import get_config
from fleet.platform.errors import DomainError, ErrorKind

log = logging.getLogger(__name__)


class _Unset(enum.Enum):
    UNSET = "unset"


UNSET = _Unset.UNSET  # "leave this field alone" (None means "clear the override")


class FleetLimitError(DomainError):
    """A fleet change refused: ``kind`` is not found, conflict (state) or invalid (a value)."""


def effective_limit(tenant: Tenant) -> int:
    """The tenant's hard ceiling on agents (override, else the platform default)."""
    return tenant.effective_limit(get_config().default_max_agents)


# The same rule as a JSON Schema pattern, for the API's document: no C0/C1 control characters.
REASON_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]*$"


def check_reason(reason: object) -> str:
    """A person's free-text reason for a change, trimmed; INVALID when it is not one line of
    at most ``REASON_MAX_CHARS`` characters (control characters would garble the audit
    trail, and PostgreSQL refuses a NUL)."""
    if reason is None:
        return ""
    if not isinstance(reason, str):
        raise FleetLimitError(ErrorKind.INVALID, f"reason must be a string, got {reason!r}")
    reason = reason.strip()
    if len(reason) > REASON_MAX_CHARS:
        raise FleetLimitError(
            ErrorKind.INVALID,
            f"reason must be at most {REASON_MAX_CHARS} characters, got {len(reason)}",
        )
    if any(unicodedata.category(ch) == "Cc" for ch in reason):
        raise FleetLimitError(
            ErrorKind.INVALID, "reason must be one line of text without control characters"
        )
    return reason


def _with_reason(note: str, reason: str) -> str:
    """A system note (a clamp's cause) and the person's reason for the change that caused it."""
    return f"{note}; {reason}" if note and reason else note or reason


def record_change(
    tenant_id: int,
    field: str,
    old: int | None,
    new: int | None,
    reason: str,
    actor: str,
    at: datetime | None = None,
    note: str = "",
) -> FleetChange:
    """Append one audit row (callers do this inside the transaction that made the change)."""
    return FleetChange.objects.create(
        tenant_id=tenant_id,
        field=field,
        old_value=old,
        new_value=new,
        reason=reason,
        actor=actor[:200],
        note=note[:NOTE_MAX_CHARS],
        at=at or timezone.now(),
    )


SYSTEM_ACTOR = "system"  # a change no person asked for: the server enforcing a bound


def clamp_to_limits(
    default_max: int | None = None, at: datetime | None = None
) -> list[FleetChange]:
    """Pull every tenant's desired_count above its effective limit down to the limit.

    The one owner of the invariant desired_count <= effective limit for changes that do
    not pass through :func:`set_fleet_overrides` (which clamps in its own transaction):
    ``serve`` calls it at boot, once the configuration is read, and the autoscaler and the
    reconciler at the start of every tick, so no path acts on a count above the limit.

    One statement: the CTE locks exactly the rows above their limit (re-checked after any
    concurrent writer commits), so servers booting together clamp each tenant once, and a
    tenant already within its limit is not touched and gets no audit row.  Disabled tenants
    are clamped too: the bound holds for the row, not only for what runs.
    """
    if default_max is None:
        default_max = get_config().default_max_agents
    at = at or timezone.now()
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            """
            WITH above AS (
                SELECT id, desired_count FROM fleet_tenant
                WHERE desired_count > COALESCE(max_agents_override, %s)
                FOR UPDATE
            )
            UPDATE fleet_tenant t SET desired_count = COALESCE(t.max_agents_override, %s)
            FROM above WHERE t.id = above.id
            RETURNING t.id, t.name, above.desired_count, t.desired_count, t.max_agents_override
            """,
            [default_max, default_max],
        )
        changes = []
        for tenant_id, name, old, new, override in cursor.fetchall():
            cause = _clamp_cause(override, new)
            log.warning("tenant %s: desired_count %d clamped to %d (%s)", name, old, new, cause)
            changes.append(
                record_change(
                    tenant_id,
                    "desired_count",
                    old,
                    new,
                    ChangeReason.CLAMP,
                    SYSTEM_ACTOR,
                    at,
                    note=cause,
                )
            )
        changes += fit_pools_to_totals(SYSTEM_ACTOR, at)
        return changes


def fit_pools_to_totals(
    actor: str, at: datetime | None = None, tenant_id: int | None = None
) -> list[FleetChange]:
    """Lower named pools whose counts add up to more than their tenant's desired_count.

    The tenant total bounds the pools (the default pool holds the remainder), so when the
    total drops, the default pool gives up its agents first (nothing to write: its count is
    the remainder) and then the named pools, **newest pool first**, each down to 0 before
    the next is touched: deterministic, and the pools an operator set up first keep their
    agents longest.  Each lowered pool gets a ``clamp`` audit row (field ``pool:<name>``).
    Runs in the caller's transaction when there is one; ``tenant_id`` limits it to one tenant.
    """
    at = at or timezone.now()
    with transaction.atomic(), connection.cursor() as cursor:
        # Lock the tenant rows first (every pool writer does, so the order never deadlocks).
        cursor.execute(
            f"""
            SELECT id, desired_count FROM fleet_tenant
            WHERE (%s::bigint IS NULL OR id = %s) AND desired_count < {NAMED_POOLS_TOTAL_SQL}
            ORDER BY id FOR UPDATE
            """,
            [tenant_id, tenant_id],
        )
        over = cursor.fetchall()
        changes = []
        for tid, total in over:
            cursor.execute(
                "SELECT id, name, desired_count FROM fleet_agentpool "
                "WHERE tenant_id = %s AND desired_count > 0 ORDER BY id DESC",
                [tid],
            )
            pools = cursor.fetchall()
            excess = sum(count for _pk, _name, count in pools) - total
            for pk, name, count in pools:
                if excess <= 0:
                    break
                new = count - min(count, excess)
                excess -= count - new
                cursor.execute(
                    "UPDATE fleet_agentpool SET desired_count = %s WHERE id = %s", [new, pk]
                )
                note = f"the tenant's desired_count dropped to {total}: pools shrink newest first"
                log.warning(
                    "tenant %s: pool %s desired_count %d clamped to %d", tid, name, count, new
                )
                changes.append(
                    record_change(
                        tid, pool_field(name), count, new, ChangeReason.CLAMP, actor, at, note=note
                    )
                )
        return changes


def move_pool_count(
    tenant_id: int, pool_id: int | None, delta: int, actor: str, reason: str, note: str = ""
) -> int:
    """Tenant total (and named pool ``pool_id``'s count) += ``delta``, audited; returns the
    new total.  No bound is checked here: the caller (:mod:`fleet.control.pools`) holds the
    tenant row lock and checked the limit and the pool's count under it."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE fleet_tenant SET desired_count = desired_count + %s WHERE id = %s "
            "RETURNING desired_count",
            [delta, tenant_id],
        )
        total = cursor.fetchone()[0]
        record_change(tenant_id, "desired_count", total - delta, total, reason, actor, note=note)
        if pool_id is not None:
            cursor.execute(
                "UPDATE fleet_agentpool SET desired_count = desired_count + %s WHERE id = %s "
                "RETURNING name, desired_count",
                [delta, pool_id],
            )
            name, count = cursor.fetchone()
            record_change(
                tenant_id, pool_field(name), count - delta, count, reason, actor, note=note
            )
    return total


def pool_field(name: str) -> str:
    """The audit trail's ``field`` for a named pool's desired_count."""
    return f"pool:{name}"


def _clamp_cause(override: int | None, limit: int) -> str:
    """What set the limit a clamp enforced: the tenant's override, else the platform default."""
    if override is None:
        return f"platform default max agents (CLOACINA_DEFAULT_MAX_AGENTS) lowered to {limit}"
    return f"max_agents_override lowered to {limit}"


def _step(tenant: Tenant, actor: str, delta: int, reason: str = "") -> int:
    """desired_count += delta in one statement, guarded by the bound; audit in the same txn."""
    reason = check_reason(reason)
    default_max = get_config().default_max_agents
    # Deprovisioning acts on the default pool: it holds what the named pools do not.
    bound_sql = (
        "desired_count < COALESCE(max_agents_override, %s)"
        if delta > 0
        else f"desired_count > {NAMED_POOLS_TOTAL_SQL}"
    )
    params = [delta, tenant.pk] + ([default_max] if delta > 0 else [])
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE fleet_tenant SET desired_count = desired_count + %s "
            f"WHERE id = %s AND is_active AND {bound_sql} RETURNING desired_count",
            params,
        )
        row = cursor.fetchone()
        if row is not None:
            new = row[0]
            record_change(
                tenant.pk,
                "desired_count",
                new - delta,
                new,
                ChangeReason.MANUAL,
                actor,
                note=reason,
            )
            tenant.desired_count = new
            return new
    raise _refusal(tenant.pk, delta, default_max)


# What a tenant's named pools hold together (the default pool holds the rest of desired_count);
# correlated on the ``fleet_tenant`` row of the statement it is part of.
NAMED_POOLS_TOTAL_SQL = (
    "(SELECT COALESCE(SUM(p.desired_count), 0) FROM fleet_agentpool p "
    "WHERE p.tenant_id = fleet_tenant.id)"
)


def _refusal(tenant_id: int, delta: int, default_max: int) -> FleetLimitError:
    """Why the guarded UPDATE matched no row, as the error the caller sees."""
    current = Tenant.objects.filter(pk=tenant_id).first()
    if current is None:
        return FleetLimitError(ErrorKind.NOT_FOUND, "tenant does not exist")
    if not current.is_active:
        return FleetLimitError(ErrorKind.CONFLICT, f"tenant {current.name!r} is disabled")
    if delta > 0:
        limit = current.effective_limit(default_max)
        return FleetLimitError(
            ErrorKind.CONFLICT,
            f"desired_count is already at the effective limit ({limit}); "
            "only a platform admin can raise the limit",
        )
    if current.desired_count > 0:
        return FleetLimitError(
            ErrorKind.CONFLICT,
            f"the default pool has no agent to deprovision: named pools hold all "
            f"{current.desired_count} of desired_count; deprovision one of those pools instead",
        )
    return FleetLimitError(
        ErrorKind.CONFLICT, "desired_count is already 0; there is nothing to deprovision"
    )


def provision(tenant: Tenant, actor: str, reason: str = "") -> int:
    """desired_count + 1 (tenant self-service); a conflict at the effective limit."""
    return _step(tenant, actor, +1, reason)


def deprovision(tenant: Tenant, actor: str, reason: str = "") -> int:
    """desired_count − 1 down to 0 (the autoscaler's floor does not apply); a conflict at 0."""
    return _step(tenant, actor, -1, reason)


# Far above any fleet; keeps the numbers inside their integer columns (a larger one was a 500).
AGENTS_MAX = 100_000


def _check_count(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise FleetLimitError(
            ErrorKind.INVALID, f"{name} must be a non-negative integer, got {value!r}"
        )
    if value > AGENTS_MAX:
        raise FleetLimitError(
            ErrorKind.INVALID, f"{name} must be at most {AGENTS_MAX}, got {value}"
        )
    return value


def set_fleet_overrides(
    tenant: Tenant,
    actor: str,
    max_agents_override: int | None | _Unset = UNSET,
    desired_count: int | None | _Unset = UNSET,
    reason: str = "",
) -> Tenant:
    """Platform-admin change of a tenant's ceiling and/or desired_count.

    ``max_agents_override=None`` clears the override (back to the platform
    default).  Lowering the limit below desired_count clamps desired_count and
    records that as a ``clamp`` change.  An explicit desired_count above the
    (new) limit is refused as invalid and nothing is changed.  ``reason`` (the
    person's words) goes into each audit row's note.
    """
    reason = check_reason(reason)
    if max_agents_override is not UNSET:
        max_agents_override = _check_count("max_agents_override", max_agents_override)
    if desired_count is not UNSET:
        if desired_count is None:
            raise FleetLimitError(
                ErrorKind.INVALID, "desired_count must be a non-negative integer, got None"
            )
        desired_count = _check_count("desired_count", desired_count)
    default_max = get_config().default_max_agents
    with transaction.atomic():
        current = Tenant.objects.select_for_update().filter(pk=tenant.pk).first()
        if current is None:
            raise FleetLimitError(ErrorKind.NOT_FOUND, "tenant does not exist")
        now = timezone.now()
        old_override, old_desired = current.max_agents_override, current.desired_count
        desired_note = ""
        if max_agents_override is not UNSET:
            current.max_agents_override = max_agents_override
        limit = current.effective_limit(default_max)
        if desired_count is not UNSET:
            if desired_count > limit:
                raise FleetLimitError(
                    ErrorKind.INVALID,
                    f"desired_count {desired_count} exceeds the effective limit ({limit})",
                )
            current.desired_count = desired_count
            desired_reason = ChangeReason.ADMIN
        elif current.desired_count > limit:
            current.desired_count = limit
            desired_reason = ChangeReason.CLAMP
            desired_note = _clamp_cause(current.max_agents_override, limit)
        current.save(update_fields=["max_agents_override", "desired_count"])
        if current.max_agents_override != old_override:
            record_change(
                current.pk,
                "max_agents_override",
                old_override,
                current.max_agents_override,
                ChangeReason.ADMIN,
                actor,
                now,
                note=reason,
            )
        if current.desired_count != old_desired:
            record_change(
                current.pk,
                "desired_count",
                old_desired,
                current.desired_count,
                desired_reason,
                actor,
                now,
                note=_with_reason(desired_note, reason),
            )
            fit_pools_to_totals(actor, now, current.pk)
    tenant.max_agents_override = current.max_agents_override
    tenant.desired_count = current.desired_count
    return current


# The columns' own ceilings (PositiveIntegerField, PositiveBigIntegerField): larger was a 500.
BACKLOG_MAX = 2**31 - 1
STORAGE_BYTES_MAX = 2**63 - 1


def _check_bound(name: str, value: object, ceiling: int, nullable: bool = False) -> int | None:
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= ceiling:
        raise FleetLimitError(
            ErrorKind.INVALID, f"{name} must be an integer from 0 to {ceiling}, got {value!r}"
        )
    return value


def _check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise FleetLimitError(ErrorKind.INVALID, f"{name} must be true or false, got {value!r}")
    return value


def _as_number(value: int | bool | None) -> int | None:
    return int(value) if isinstance(value, bool) else value


def _checked_settings(
    max_backlog: int | _Unset, is_active: bool | _Unset, storage_quota_bytes: int | None | _Unset
) -> dict[str, object]:
    """The given non-fleet limits, each checked (INVALID names the first bad one)."""
    checked: dict[str, object] = {}
    if max_backlog is not UNSET:
        checked["max_backlog"] = _check_bound("max_backlog", max_backlog, BACKLOG_MAX)
    if is_active is not UNSET:
        checked["is_active"] = _check_flag("is_active", is_active)
    if storage_quota_bytes is not UNSET:
        checked["storage_quota_bytes"] = _check_bound(
            "storage_quota_bytes", storage_quota_bytes, STORAGE_BYTES_MAX, nullable=True
        )
    return checked


def _apply_settings(current: Tenant, values: dict[str, object], actor: str, reason: str) -> None:
    """Write the values that differ on the locked row, one audit row each (caller's txn)."""
    changed = [name for name, value in values.items() if getattr(current, name) != value]
    now = timezone.now()
    for name in changed:
        old = getattr(current, name)
        setattr(current, name, values[name])
        record_change(
            current.pk,
            name,
            _as_number(old),
            _as_number(values[name]),
            ChangeReason.ADMIN,
            actor,
            now,
            note=reason,
        )
    if changed:
        current.save(update_fields=changed)


def set_tenant_limits(
    tenant: Tenant,
    actor: str,
    reason: str = "",
    *,
    max_agents_override: int | None | _Unset = UNSET,
    desired_count: int | None | _Unset = UNSET,
    max_backlog: int | _Unset = UNSET,
    is_active: bool | _Unset = UNSET,
    storage_quota_bytes: int | None | _Unset = UNSET,
) -> Tenant:
    """A platform admin's change of any of a tenant's limits, audited field by field.

    The Django admin and ``PUT /admin/tenants/{tenant}/fleet`` call this (the fleet
    numbers go through :func:`set_fleet_overrides` inside the same transaction, with its
    bounds and clamp).  Every value is checked before anything is written, so a refused
    change changes nothing; an unchanged value writes no audit row.  ``max_backlog`` 0 means
    the platform's; ``storage_quota_bytes`` None means the platform's, 0 unlimited.
    """
    reason = check_reason(reason)
    settings = _checked_settings(max_backlog, is_active, storage_quota_bytes)
    counts = {
        name: value
        for name, value in (
            ("max_agents_override", max_agents_override),
            ("desired_count", desired_count),
        )
        if value is not UNSET
    }
    with transaction.atomic():
        current = Tenant.objects.select_for_update().filter(pk=tenant.pk).first()
        if current is None:
            raise FleetLimitError(ErrorKind.NOT_FOUND, "tenant does not exist")
        if counts:
            current = set_fleet_overrides(current, actor, reason=reason, **counts)
        _apply_settings(current, settings, actor, reason)
    for name in AUDITED_FIELDS:
        setattr(tenant, name, getattr(current, name))
    return current


def backlog_count(tenant_id: int, now: datetime | None = None) -> int:
    """Ready tasks of the tenant that are due and waiting for an agent to take them."""
    return backlog_counts([tenant_id], now).get(tenant_id, 0)


def backlog_counts(tenant_ids: list[int] | QuerySet, now: datetime | None = None) -> dict[int, int]:
    """:func:`backlog_count` of many tenants in one grouped query (absent: 0); ``tenant_ids``
    is a list or a query of ids."""
    now = now or timezone.now()
    return dict(
        TaskExecution.objects.filter(tenant_id__in=tenant_ids, status=TaskStatus.READY)
        .filter(Q(ready_at__isnull=True) | Q(ready_at__lte=now))
        .values_list("tenant_id")
        .annotate(n=Count("id"))
        .values_list("tenant_id", "n")
    )


def fleet_snapshot(tenant: Tenant) -> dict:
    """The tenant's fleet numbers in one dict (GET /fleet and the console read this)."""
    return fleet_snapshots([tenant])[tenant.pk]


SNAPSHOT_FIELDS = ("desired_count", "max_agents_override", "is_active", "last_autoscaled_at")


def fleet_snapshots(
    tenants: list[Tenant],
    refresh: bool = True,
    scope: QuerySet | None = None,
    outbox_open: dict[int, int] | None = None,
) -> dict[int, dict]:
    """:func:`fleet_snapshot` of many tenants in four grouped queries, whatever their number
    (the console's overview lists hundreds): tenant id → snapshot.  Each tenant object is
    refreshed in place, as a caller holding a stale row (after a change) expects; a caller
    that has just read the rows passes ``refresh=False`` and saves that query.

    ``scope``, a query of exactly these tenants' ids, is used in SQL instead of the list of
    ids: with hundreds of tenants, binding hundreds of parameters into each of the grouped
    queries costs more CPU than PostgreSQL running the subquery.  ``outbox_open`` (tenant id →
    open outbox rows; absent: 0), when the caller has just counted them, saves that query."""
    ids = scope if scope is not None else [t.pk for t in tenants]
    fresh = {}
    if refresh:
        rows = Tenant.objects.filter(pk__in=ids).values("id", *SNAPSHOT_FIELDS)
        fresh = {row["id"]: row for row in rows}
    live = Q(state=AgentState.LIVE)
    agents = {
        row["tenant_id"]: row
        for row in Agent.objects.filter(tenant_id__in=ids)
        .values("tenant_id")
        .annotate(
            total=Count("id", filter=Q(state__in=ACTIVE_STATES)),
            live=Count("id", filter=live),
            draining=Count("id", filter=Q(state=AgentState.DRAINING)),
            in_flight=Sum("in_flight", filter=live),
            capacity=Sum("max_concurrency", filter=live),
        )
    }
    outbox = (
        outbox_open
        if outbox_open is not None
        else dict(
            DeliveryOutbox.objects.filter(tenant_id__in=ids)
            .exclude(state=OutboxState.ACKED)
            .values_list("tenant_id")
            .annotate(n=Count("id"))
            .values_list("tenant_id", "n")
        )
    )
    backlog = backlog_counts(ids)
    snapshots = {}
    for tenant in tenants:
        # Only from a fresh row: a tenant built with few fields (the API key cache's) would
        # load each deferred field with a query of its own if it were read here.
        row = fresh.get(tenant.pk)
        if row is not None:
            for name in SNAPSHOT_FIELDS:
                setattr(tenant, name, row[name])
        agg = agents.get(tenant.pk, {})
        in_flight, capacity = agg.get("in_flight") or 0, agg.get("capacity") or 0
        snapshots[tenant.pk] = {
            "tenant": tenant.name,
            "is_active": tenant.is_active,
            "desired_count": tenant.desired_count,
            "effective_limit": effective_limit(tenant),
            "max_agents_override": tenant.max_agents_override,
            "overridden": tenant.max_agents_override is not None,
            "utilization": (in_flight / capacity) if capacity else None,
            "backlog": backlog.get(tenant.pk, 0),
            "outbox_open": outbox.get(tenant.pk, 0),
            "agents_live": agg.get("live", 0),
            "agents_draining": agg.get("draining", 0),
            "agents_total": agg.get("total", 0),
            "in_flight": in_flight,
            "capacity": capacity,
            "last_autoscaled_at": tenant.last_autoscaled_at,
        }
    return snapshots
