"""The tenant page: agent roster, fleet numbers with provision/deprovision, overrides, audit,
and the tenant's server-side package builds.

Mutations go through the control plane (``fleet.control.limits``) so the
console, the REST API and the admin share one set of bounds and one audit trail.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from urllib.parse import urlencode

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone

from agents.models import ENDED_STATES, Agent, AgentState
from artifacts.builds import jobs as build_jobs
from fleet.api import agent_list
from fleet.api.error_status import http_status
from fleet.console import filters
from fleet.console.access import (
    get_rw_tenant_for_user,
    get_tenant_for_user,
    is_platform_admin,
    require_platform_admin,
)
from fleet.console.fleet_rows import tenant_rows
from fleet.console.health import health_context
from fleet.console.responses import ConsoleError, action_done, console_view
from fleet.control import limits, pools
from fleet.executors.fleet.routing import health, phases
from fleet.executors.fleet.state import breaker
from fleet.models import AutoscaleDecision, FleetChange, Tenant
from fleet.platform.config import get_config

# Dead agents stay listed this long, so a crash is visible after the sweeper ran.
RECENTLY_DEAD = timedelta(hours=1)
DECISIONS_SHOWN = 20
CHANGES_SHOWN = 30
BUILDS_SHOWN = 10
# A heartbeat this many intervals old is late (shown amber) before it is fatal.
LATE_AFTER_INTERVALS = 1.5
ROSTER_PAGE_SIZE = 25  # rows are rendered by the template engine: its cost is per row
ROSTER_SORT = "state"  # live, draining, stopped, dead; by name within each


@dataclass
class RosterEntry:
    agent: Agent
    heartbeat_age_s: float
    late: bool  # missed a beat
    overdue: bool  # past the liveness window: the sweeper should evict it
    health: str = (
        ""  # fleet.executors.fleet.routing.health: healthy, degraded, unhealthy, draining, dead
    )
    phase: str = ""  # fleet.executors.fleet.routing.phases
    breaker: str = ""  # fleet.executors.fleet.state.breaker: closed, open, half_open
    drain_url: str = ""  # the row's Drain form (live agents only)
    # Worked out here once rather than by template conditions in every row (the template
    # engine's cost is per lookup): "bad" (overdue), "warn" (late) or "".
    level: str = ""
    health_class: str = ""  # the health note's cell class (degraded, unhealthy), else ""
    health_title: str = ""


HEALTH_NOTES = {  # health → (cell class, tooltip) of the note beside the state
    "degraded": (
        "cell-warn",
        "heartbeat older than 2 intervals, socket open: chosen only after healthy agents",
    ),
    "unhealthy": ("cell-bad", "no socket or no recent heartbeat: not chosen for work"),
}


def actor_of(request: HttpRequest) -> str:
    """How console changes are signed in the audit trail."""
    return f"console:{request.user.get_username()}"


def phase_and_breaker(agent: Agent, now: datetime) -> dict[str, str]:
    """The agent's phase and breaker state, derived from its row (no query)."""
    phase = phases.of(
        agent.state, bool(agent.connected_to), agent.connection_generation,
        agent.in_flight, agent.max_concurrency,
    )  # fmt: skip
    return {"phase": phase, "breaker": breaker.state_of(agent.breaker_open_until, now)}


def drain_urls(tenant: Tenant) -> Callable[[uuid.UUID], str]:
    """Agent id → its drain URL, reversed once per page rather than once per row (the
    template engine's ``{% url %}`` in every row was a large share of the table's cost)."""
    pattern = reverse("console:drain_agent", args=[tenant.name, _ANY_AGENT])
    return lambda agent_id: pattern.replace(str(_ANY_AGENT), str(agent_id))


_ANY_AGENT = uuid.UUID(int=0)


def roster_entry(agent: Agent, now: datetime, drain_url: str = "") -> RosterEntry:
    """One row of the agents table: heartbeat age, lateness, health, phase and breaker;
    ``drain_url`` is shown for a live agent."""
    config = get_config()
    age = (now - agent.last_heartbeat).total_seconds()
    alive = agent.state not in ENDED_STATES
    late = alive and age > config.heartbeat_interval_s * LATE_AFTER_INTERVALS
    overdue = alive and age > config.liveness_window_s
    kind = health.classify(
        agent.state, agent.connected_to, agent.last_heartbeat, now,
        config.heartbeat_interval_s, config.liveness_window_s,
    )  # fmt: skip
    note_class, note_title = HEALTH_NOTES.get(kind, ("", ""))
    return RosterEntry(
        agent=agent,
        drain_url=drain_url if agent.state == AgentState.LIVE else "",
        heartbeat_age_s=age,
        late=late,
        overdue=overdue,
        health=kind,
        level="bad" if overdue else "warn" if late else "",
        health_class=note_class,
        health_title=note_title,
        **phase_and_breaker(agent, now),
    )


def roster_filter(request: HttpRequest, tenant: Tenant) -> agent_list.AgentFilter:
    """The agents table's ``?state=&health=&tag=&pool=&sort=`` (live first, then by name)."""
    get = request.GET
    wanted = agent_list.AgentFilter(
        state=get.get("state", "").strip(),
        health=get.get("health", "").strip(),
        tag=get.get("tag", "").strip(),
        pool=get.get("pool", "").strip(),
        sort=get.get("sort", "").strip() or ROSTER_SORT,
    )
    try:
        return wanted.checked(tenant)
    except agent_list.BadListing as exc:
        raise ConsoleError(exc.detail, http_status(exc)) from None


def roster(request: HttpRequest, tenant: Tenant) -> dict:
    """One page of live and draining agents, then the recently dead or stopped, filtered
    and sorted as the query string says (two queries, whatever the fleet's size)."""
    now = timezone.now()
    wanted = roster_filter(request, tenant)
    agents = Agent.objects.filter(tenant=tenant).exclude(
        state__in=ENDED_STATES, dead_at__lt=now - RECENTLY_DEAD
    )
    listed = agent_list.filter_agents(agents, wanted, now)
    number = filters.page_number(request)
    page = agent_list.page_of(listed, ROSTER_PAGE_SIZE, (number - 1) * ROSTER_PAGE_SIZE)
    pages = max(1, -(-page.total // ROSTER_PAGE_SIZE))
    if number > pages:  # the list shrank under a polled page (or a stale link): its last page
        number = pages
        page = agent_list.page_of(listed, ROSTER_PAGE_SIZE, (number - 1) * ROSTER_PAGE_SIZE)
    drain_url = drain_urls(tenant)
    return {
        "roster": [roster_entry(agent, now, drain_url(agent.id)) for agent in page.rows],
        "roster_filter": wanted,
        "roster_total": page.total,
        "roster_page": number,
        "roster_pages": pages,
        "roster_query": filters.query_without_page(request),
        "sort_links": sort_links(request, wanted.sort),
        "sorts": agent_list.SORT_KEYS,
        "states": agent_list.STATES,
        "healths": agent_list.HEALTHS,
    }


def sort_links(request: HttpRequest, current: str) -> dict[str, dict[str, str]]:
    """Per sortable column: the link that sorts by it (reversed when it already does) and
    the arrow that shows the current order."""
    kept = [(k, v) for k, v in request.GET.items() if k not in ("page", "sort") and v]
    links = {}
    for key in agent_list.SORT_KEYS:
        target = f"-{key}" if current == key else key
        arrow = "▲" if current == key else "▼" if current == f"-{key}" else ""
        links[key] = {"href": "?" + urlencode([*kept, ("sort", target)]), "arrow": arrow}
    return links


def _fleet_part(request: HttpRequest, tenant: Tenant, can_write: bool) -> dict:
    row = tenant_rows([tenant], None if can_write else set())[0]
    return {"row": row}


def _roster_part(request: HttpRequest, tenant: Tenant, can_write: bool) -> dict:
    return {**roster(request, tenant), "liveness_window_s": get_config().liveness_window_s}


def _health_part(request: HttpRequest, tenant: Tenant, can_write: bool) -> dict:
    return health_context(request, tenant)


def _decisions_part(request: HttpRequest, tenant: Tenant, can_write: bool) -> dict:
    return {"decisions": AutoscaleDecision.objects.filter(tenant=tenant)[:DECISIONS_SHOWN]}


def _changes_part(request: HttpRequest, tenant: Tenant, can_write: bool) -> dict:
    return {"changes": FleetChange.objects.filter(tenant=tenant)[:CHANGES_SHOWN]}


def _pools_part(request: HttpRequest, tenant: Tenant, can_write: bool) -> dict:
    states = pools.list_pools(tenant, refresh=False)  # the view read the tenant just now
    limit = limits.effective_limit(tenant)
    return {"pools": states, "pools_at_limit": tenant.desired_count >= limit, "limit": limit}


def _builds_part(request: HttpRequest, tenant: Tenant, can_write: bool) -> dict:
    builds = build_jobs.recent_jobs(tenant, BUILDS_SHOWN)
    return {"builds": builds, "builds_active": any(b.active for b in builds)}


# Each partial is the template the page includes, rendered alone for htmx polling.
PARTIALS = {
    "fleet": ("console/partials/tenant_fleet.html", _fleet_part),
    "agents": ("console/partials/tenant_roster.html", _roster_part),
    "pools": ("console/partials/tenant_pools.html", _pools_part),
    "health": ("console/partials/tenant_health.html", _health_part),
    "decisions": ("console/partials/tenant_decisions.html", _decisions_part),
    "changes": ("console/partials/tenant_changes.html", _changes_part),
    "builds": ("console/partials/tenant_builds.html", _builds_part),
}


def _base_context(request: HttpRequest, tenant: Tenant, can_write: bool) -> dict:
    return {
        "tenant": tenant,
        "can_write": can_write,
        "is_platform_admin": is_platform_admin(request.user),
        "reason_max_chars": limits.REASON_MAX_CHARS,
    }


@console_view()
def tenant_page(request: HttpRequest, name: str) -> HttpResponse:
    tenant, can_write = get_tenant_for_user(request, name)
    context = _base_context(request, tenant, can_write)
    for _, part in PARTIALS.values():
        context.update(part(request, tenant, can_write))
    return render(request, "console/tenant.html", context)


@console_view()
def tenant_partial(request: HttpRequest, name: str, part: str) -> HttpResponse:
    tenant, can_write = get_tenant_for_user(request, name)
    if part not in PARTIALS:
        raise ConsoleError(f"unknown tenant partial {part!r}", 404)
    template, build = PARTIALS[part]
    context = _base_context(request, tenant, can_write) | build(request, tenant, can_write)
    return render(request, template, context)


def _scale(request: HttpRequest, name: str, step: int) -> HttpResponse:
    """desired_count ± 1 through the control plane (one guarded statement + audit row),
    with the optional ``reason`` the form sent."""
    tenant = get_rw_tenant_for_user(request, name)
    change = limits.provision if step > 0 else limits.deprovision
    try:
        new = change(tenant, actor_of(request), request.POST.get("reason", ""))
    except limits.FleetLimitError as exc:
        raise ConsoleError(f"{tenant.name}: {exc}", http_status(exc)) from None
    # The step is atomic, so the value before it is exactly new − step (the row
    # read above may be stale if someone else scaled in between).
    return action_done(
        request,
        f"{tenant.name}: desired_count {new - step} → {new}",
        back_url(request, tenant),
    )


@console_view(methods=["POST"])
def provision(request: HttpRequest, name: str) -> HttpResponse:
    return _scale(request, name, +1)


@console_view(methods=["POST"])
def deprovision(request: HttpRequest, name: str) -> HttpResponse:
    return _scale(request, name, -1)


@console_view(methods=["POST"])
def fleet_overrides(request: HttpRequest, name: str) -> HttpResponse:
    """Platform admin: set the limit override (blank clears it) and/or desired_count."""
    tenant, _ = get_tenant_for_user(request, name)
    require_platform_admin(request)
    changes: dict = {}
    if "max_agents_override" in request.POST:
        changes["max_agents_override"] = _parse_count(
            request.POST["max_agents_override"], "max_agents_override", blank_ok=True
        )
    if "desired_count" in request.POST:
        changes["desired_count"] = _parse_count(request.POST["desired_count"], "desired_count")
    if not changes:
        raise ConsoleError("nothing to change: send max_agents_override and/or desired_count")
    try:
        tenant = limits.set_fleet_overrides(
            tenant, actor_of(request), reason=request.POST.get("reason", ""), **changes
        )
    except limits.FleetLimitError as exc:
        raise ConsoleError(f"{tenant.name}: {exc}", http_status(exc)) from None
    limit = "platform default" if tenant.max_agents_override is None else tenant.max_agents_override
    return action_done(
        request,
        f"{tenant.name}: limit override {limit}, desired_count {tenant.desired_count}",
        back_url(request, tenant),
    )


def _parse_count(raw: str, field: str, blank_ok: bool = False) -> int | None:
    raw = raw.strip()
    if raw == "" and blank_ok:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        hint = " or empty for the platform default" if blank_ok else ""
        raise ConsoleError(f"{field} must be a whole number ≥ 0{hint}, got {raw!r}")
    return value


def back_url(request: HttpRequest, tenant: Tenant) -> str:
    """Where a plain form post returns: the page it came from if it is ours, else the tenant page."""
    back = request.POST.get("next", "")
    if back.startswith("/console/") and not back.startswith("//"):
        return back
    return reverse("console:tenant", args=[tenant.name])
