"""The numbers behind the overview: one row per tenant, with what is wrong spelled out.

The fleet numbers themselves come from the control plane's ``fleet_snapshots``
(one definition of utilization and backlog for the API, the autoscaler and the
console).  What the snapshot does not carry (evictions in the last hour, the
last autoscaler decision, the age of the oldest outbox rows) is read here in
one grouped query per kind for all tenants at once: a page of the overview costs
the same handful of queries for 5 tenants or 500.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta

from django.db.models import Count, Min, QuerySet
from django.utils import timezone

from fleet.console.formatting import human_seconds
from fleet.control import limits
from fleet.models import AutoscaleDecision, DeliveryOutbox, Eviction, OutboxState, Tenant
from fleet.platform.config import get_config

EVICTION_WINDOW = timedelta(hours=1)
# A packet pending this many redelivery periods has not moved: delivery is wedged.
WEDGED_REDELIVERY_PERIODS = 3
MIN_WEDGED_AFTER_S = 30.0

OK, WARN, BAD = 0, 1, 2
SEVERITY_NAMES = {OK: "ok", WARN: "warn", BAD: "bad"}


@dataclass(frozen=True)
class Problem:
    severity: int
    text: str

    @property
    def level(self) -> str:
        return SEVERITY_NAMES[self.severity]


@dataclass
class TenantRow:
    tenant: Tenant
    can_write: bool
    desired_count: int
    effective_limit: int
    overridden: bool
    agents_live: int
    agents_draining: int
    agents_total: int  # not dead
    utilization: float | None
    in_flight: int
    backlog: int
    outbox_open: int
    oldest_pending_age_s: float | None
    oldest_delivered_age_s: float | None
    evictions_last_hour: int
    last_decision: AutoscaleDecision | None
    problems: list[Problem] = field(default_factory=list)

    @property
    def severity(self) -> int:
        return max((p.severity for p in self.problems), default=OK)

    @property
    def level(self) -> str:
        return SEVERITY_NAMES[self.severity]

    @property
    def at_upper_bound(self) -> bool:
        return self.desired_count >= self.effective_limit

    @property
    def at_lower_bound(self) -> bool:
        return self.desired_count <= 0


def wedged_after_s() -> float:
    """How old a pending outbox row may get before the console calls delivery wedged."""
    return max(MIN_WEDGED_AFTER_S, get_config().outbox_redeliver_s * WEDGED_REDELIVERY_PERIODS)


def tenant_rows(tenants: Iterable[Tenant], writable: set[int] | None) -> list[TenantRow]:
    """One row per tenant, most urgent first (then by name) so trouble is at the top.

    Given a query (the overview's hundreds of tenants), its ids go into each grouped query
    as a subquery rather than as hundreds of bound parameters, which cost more CPU to bind
    than PostgreSQL spends on the subquery."""
    scope = tenants.order_by().values("pk") if isinstance(tenants, QuerySet) else None
    tenants = list(tenants)
    ids = scope if scope is not None else [t.pk for t in tenants]
    now = timezone.now()
    evictions = dict(
        Eviction.objects.filter(tenant_id__in=ids, evicted_at__gte=now - EVICTION_WINDOW)
        .values_list("tenant_id")
        .annotate(n=Count("id"))
        .values_list("tenant_id", "n")
    )
    decisions = {
        d.tenant_id: d
        for d in AutoscaleDecision.objects.filter(tenant_id__in=ids)
        .order_by("tenant_id", "-at", "-id")
        .distinct("tenant_id")
    }
    oldest = oldest_open_rows(ids)
    # The console's views read the tenants in this request: no need to read them again;
    # the open rows were just counted (the same grouped query as their ages).
    snapshots = limits.fleet_snapshots(
        tenants, refresh=False, scope=scope,
        outbox_open={tenant_id: n for tenant_id, (_p, _d, n) in oldest.items()},
    )  # fmt: skip
    rows = []
    for tenant in tenants:
        snap = snapshots[tenant.pk]
        pending_at, delivered_at, _open = oldest.get(tenant.pk, (None, None, 0))
        row = TenantRow(
            tenant=tenant,
            can_write=writable is None or tenant.pk in writable,
            desired_count=snap["desired_count"],
            effective_limit=snap["effective_limit"],
            overridden=snap["overridden"],
            agents_live=snap["agents_live"],
            agents_draining=snap["agents_draining"],
            agents_total=snap["agents_total"],
            utilization=snap["utilization"],
            in_flight=snap["in_flight"],
            backlog=snap["backlog"],
            outbox_open=snap["outbox_open"],
            oldest_pending_age_s=(now - pending_at).total_seconds() if pending_at else None,
            oldest_delivered_age_s=(now - delivered_at).total_seconds() if delivered_at else None,
            evictions_last_hour=evictions.get(tenant.pk, 0),
            last_decision=decisions.get(tenant.pk),
        )
        row.problems = problems_of(row)
        rows.append(row)
    rows.sort(key=lambda r: (-r.severity, r.tenant.name))
    return rows


def oldest_open_rows(tenant_ids: list[int] | QuerySet) -> dict[int, tuple]:
    """tenant id → (since when the oldest pending row waits, when the oldest open delivery
    went out, how many rows are open: pending or delivered, i.e. not acked).

    A pending row's wait is measured from ``updated_at``: a packet reclaimed
    from a dead agent starts waiting again when it is re-addressed, the same
    clock the depth sampler uses.
    """
    result: dict[int, tuple] = {}
    for tenant_id, state, pending_since, delivered_since, count in (
        DeliveryOutbox.objects.filter(
            tenant_id__in=tenant_ids, state__in=[OutboxState.PENDING, OutboxState.DELIVERED]
        )
        .values_list("tenant_id", "state")
        .annotate(p=Min("updated_at"), d=Min("delivered_at"), n=Count("id"))
    ):
        pending, delivered, open_rows = result.get(tenant_id, (None, None, 0))
        if state == OutboxState.PENDING:
            pending = pending_since
        else:
            delivered = delivered_since
        result[tenant_id] = (pending, delivered, open_rows + count)
    return result


def problems_of(row: TenantRow) -> list[Problem]:
    """What an operator should look at for this tenant, worst first, in plain words."""
    config = get_config()
    found: list[Problem] = []
    if row.backlog and row.agents_live == 0 and config.default_executor == "fleet":
        found.append(Problem(BAD, f"{row.backlog} task(s) waiting and no live agent"))
    if row.agents_live < row.desired_count:
        missing = row.desired_count - row.agents_live
        severity = BAD if row.agents_live == 0 else WARN
        found.append(
            Problem(severity, f"{missing} of {row.desired_count} desired agent(s) missing")
        )
    if row.oldest_pending_age_s is not None and row.oldest_pending_age_s > wedged_after_s():
        found.append(
            Problem(
                BAD,
                "outbox wedged: oldest pending packet waiting "
                f"{human_seconds(row.oldest_pending_age_s)}",
            )
        )
    if row.evictions_last_hour:
        found.append(Problem(WARN, f"{row.evictions_last_hour} eviction(s) in the last hour"))
    busy = row.utilization is not None and row.utilization >= config.autoscale_up_threshold
    if busy and row.at_upper_bound:
        found.append(
            Problem(WARN, f"busy ({row.utilization:.0%}) and at the limit of {row.effective_limit}")
        )
    found.sort(key=lambda p: -p.severity)
    return found
