"""Per-agent console actions: drain (the button on the tenant page's agent row)."""

from __future__ import annotations

import uuid

from django.http import Http404, HttpRequest, HttpResponse

from agents.models import Agent
from fleet.api.error_status import http_status
from fleet.console.access import get_rw_tenant_for_user
from fleet.console.responses import ConsoleError, action_done, console_view
from fleet.console.tenants import actor_of, back_url
from fleet.executors.fleet import lifecycle
from fleet.platform.config import get_config


@console_view(methods=["POST"])
def drain_agent(request: HttpRequest, name: str, agent_id: uuid.UUID) -> HttpResponse:
    """Mark the agent draining: no new work; its in-flight work finishes, then it exits
    (evicted, its work moved on, if it is not gone by the drain deadline)."""
    tenant = get_rw_tenant_for_user(request, name)  # 404 if not visible, 403 if read-only
    if not Agent.objects.filter(pk=agent_id, tenant=tenant).exists():
        raise Http404(f"no agent {agent_id} in this tenant")
    try:
        done = lifecycle.request_drain(
            agent_id, get_config().agent_drain_timeout_s, actor_of(request)
        )
    except lifecycle.DrainRefused as exc:
        raise ConsoleError(exc.detail, http_status(exc)) from None
    return action_done(
        request,
        f"{tenant.name}: agent {done.name} draining, {done.in_flight} task(s) in flight "
        f"(evicted if still there at {done.drain_deadline:%H:%M:%S})",
        back_url(request, tenant),
    )
