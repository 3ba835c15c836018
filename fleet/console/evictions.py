"""Eviction history: which agents the liveness sweeper declared dead, and the work it moved."""

from __future__ import annotations

from django.core.paginator import Paginator
from django.db.models import F, Value
from django.db.models.functions import Greatest
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from fleet.console import filters
from fleet.console.access import tenants_for_user
from fleet.console.responses import console_view
from fleet.models import DeliveryOutbox, Eviction

DEFAULT_RANGE = "24h"


def _context(request: HttpRequest) -> dict:
    tenant = filters.tenant_filter(request)
    window = filters.time_window(request, DEFAULT_RANGE)
    visible = tenants_for_user(request.user)
    rows = (
        Eviction.objects.select_related("tenant")
        .filter(tenant__in=visible)
        # Work the sweeper could not move (no live agent): the result-wait timeout retries it.
        .annotate(waiting=Greatest(F("in_flight") - F("reassigned"), Value(0)))
    )
    if tenant is not None:
        rows = rows.filter(tenant=tenant)
    if window.since:
        rows = rows.filter(evicted_at__gte=window.since)
    if window.until:
        rows = rows.filter(evicted_at__lte=window.until)
    page = Paginator(rows.order_by("-evicted_at", "-id"), filters.PAGE_SIZE).get_page(
        filters.page_number(request)
    )
    attach_reassigned_tasks(list(page))
    return {
        "page": page,
        "tenants": visible,
        "tenant": tenant,
        "window": window,
        "ranges": list(filters.RANGES),
        "query": filters.query_without_page(request),
        "full_query": request.GET.urlencode(),
    }


def attach_reassigned_tasks(evictions: list[Eviction]) -> None:
    """Set ``eviction.moved``: the tasks whose packets were reclaimed from the evicted agent.

    A reclaimed packet remembers the agents it was taken from (``former_agents``),
    so one query finds the moved work of every eviction on the page.
    """
    by_agent: dict[str, Eviction] = {}
    for e in evictions:  # newest first: an agent's latest eviction is the one that moved its work
        by_agent.setdefault(str(e.agent_id), e)
    for e in evictions:
        e.moved = []
    if not by_agent:
        return
    rows = (
        DeliveryOutbox.objects.filter(former_agents__has_any_keys=list(by_agent))
        .select_related("task_execution", "agent")
        .order_by("created_at")
    )
    for row in rows:
        for agent_id in row.former_agents:
            if agent_id in by_agent:
                by_agent[agent_id].moved.append(row)


@console_view()
def evictions(request: HttpRequest) -> HttpResponse:
    return render(request, "console/evictions.html", _context(request))


@console_view()
def evictions_table(request: HttpRequest) -> HttpResponse:
    return render(request, "console/partials/evictions_table.html", _context(request))
