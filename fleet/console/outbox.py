"""Outbox depth: what is waiting to be pushed to agents, how old it is, and depth over time."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import Count, Min
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from fleet.console import filters
from fleet.console.access import tenants_for_user
from fleet.console.charts import DepthPoint, depth_chart_svg
from fleet.console.fleet_rows import wedged_after_s
from fleet.console.responses import console_view
from fleet.models import DeliveryOutbox, OutboxDepthSample, OutboxState, Tenant

DEFAULT_RANGE = "1h"
OLDEST_SHOWN = 10


@dataclass
class OutboxDepth:
    tenant: Tenant
    pending: int = 0
    delivered: int = 0
    acked: int = 0
    oldest_pending_at: datetime | None = None
    oldest_delivered_at: datetime | None = None
    wedged: bool = False

    @property
    def open(self) -> int:
        return self.pending + self.delivered

    def age_s(self, at: datetime | None) -> float | None:
        return (timezone.now() - at).total_seconds() if at else None

    @property
    def oldest_pending_age_s(self) -> float | None:
        return self.age_s(self.oldest_pending_at)

    @property
    def oldest_delivered_age_s(self) -> float | None:
        return self.age_s(self.oldest_delivered_at)


def depth_by_tenant(tenants: list[Tenant]) -> list[OutboxDepth]:
    """Current depth per tenant and state, in one grouped query."""
    depths = {t.pk: OutboxDepth(tenant=t) for t in tenants}
    grouped = (
        DeliveryOutbox.objects.filter(tenant_id__in=depths)
        .values_list("tenant_id", "state")
        # Pending waits from updated_at (a reclaimed packet waits anew), as fleet_rows does.
        .annotate(n=Count("id"), first=Min("updated_at"), first_delivered=Min("delivered_at"))
    )
    for tenant_id, state, n, first, first_delivered in grouped:
        depth = depths[tenant_id]
        if state == OutboxState.PENDING:
            depth.pending, depth.oldest_pending_at = n, first
        elif state == OutboxState.DELIVERED:
            depth.delivered, depth.oldest_delivered_at = n, first_delivered
        else:
            depth.acked = n
    limit = wedged_after_s()
    for depth in depths.values():
        age = depth.oldest_pending_age_s
        depth.wedged = age is not None and age > limit
    return sorted(depths.values(), key=lambda d: (not d.wedged, -d.open, d.tenant.name))


def depth_charts(depths: list[OutboxDepth], window: filters.TimeWindow) -> list[dict]:
    """One chart per tenant: the recorded samples, then the live depth as the last point."""
    now = timezone.now()
    until = window.until or now
    samples = OutboxDepthSample.objects.filter(tenant_id__in=[d.tenant.pk for d in depths])
    if window.since:
        samples = samples.filter(at__gte=window.since)
    samples = samples.filter(at__lte=until).order_by("at")
    series: dict[int, list[DepthPoint]] = {d.tenant.pk: [] for d in depths}
    for tenant_id, at, pending, delivered in samples.values_list(
        "tenant_id", "at", "pending", "delivered"
    ):
        series[tenant_id].append(DepthPoint(at, pending, delivered))
    charts = []
    for depth in depths:
        points = series[depth.tenant.pk]
        if window.until is None:
            points.append(DepthPoint(now, depth.pending, depth.delivered))
        since = window.since or (points[0].at if points else now)
        charts.append(
            {
                "tenant": depth.tenant,
                "svg": depth_chart_svg(points, since, until, depth.tenant.name),
            }
        )
    return charts


def _context(request: HttpRequest) -> dict:
    tenant = filters.tenant_filter(request)
    window = filters.time_window(request, DEFAULT_RANGE)
    visible = list(tenants_for_user(request.user))
    shown = [tenant] if tenant else visible
    depths = depth_by_tenant(shown)
    oldest = (
        DeliveryOutbox.objects.filter(
            tenant__in=shown, state__in=[OutboxState.PENDING, OutboxState.DELIVERED]
        )
        .select_related("tenant", "agent", "task_execution")
        .order_by("updated_at")[:OLDEST_SHOWN]
    )
    return {
        "depths": depths,
        "charts": depth_charts(depths, window),
        "oldest": oldest,
        "tenants": visible,
        "tenant": tenant,
        "window": window,
        "ranges": list(filters.RANGES),
        "wedged_after_s": wedged_after_s(),
        "full_query": request.GET.urlencode(),
    }


@console_view()
def outbox(request: HttpRequest) -> HttpResponse:
    return render(request, "console/outbox.html", _context(request))


@console_view()
def outbox_depth(request: HttpRequest) -> HttpResponse:
    return render(request, "console/partials/outbox_depth.html", _context(request))
