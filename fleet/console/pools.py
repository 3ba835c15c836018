"""The tenant page's agent pools: per-pool provision/deprovision, create, edit, delete.

Every action goes through the control plane (:mod:`fleet.control.pools`), so the console,
the REST API (``/api/v1/fleet/pools``) and the admin share one set of bounds, messages
and audit rows.  Forms are plain POSTs (they work without JavaScript) that htmx posts
in place; the table is the tenant page's ``pools`` partial.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse

from fleet.api.error_status import http_status
from fleet.console.access import get_rw_tenant_for_user
from fleet.console.responses import ConsoleError, action_done, console_view
from fleet.console.tenants import actor_of, back_url
from fleet.control import pools
from fleet.models import Tenant


def _refused(tenant: Tenant, exc: pools.FleetLimitError) -> ConsoleError:
    return ConsoleError(f"{tenant.name}: {exc.detail}", http_status(exc))


def _form_labels(request: HttpRequest) -> dict[str, Any]:
    """The label fields the form sent, as the control plane takes them (it validates)."""
    fields: dict[str, Any] = {}
    for name in ("tags", "capabilities"):
        if name in request.POST:
            fields[name] = [v.strip() for v in request.POST[name].split(",") if v.strip()]
    for name in ("cpu", "memory"):
        if name in request.POST:
            fields[name] = request.POST[name].strip()
    for name, blank in (("max_concurrency", None), ("gpu", 0)):
        if name in request.POST:
            raw = request.POST[name].strip()
            try:
                fields[name] = int(raw) if raw else blank
            except ValueError:
                raise ConsoleError(f"{name} must be a whole number, got {raw!r}", 422) from None
    return fields


def _step(request: HttpRequest, name: str, pool: str, delta: int) -> HttpResponse:
    tenant = get_rw_tenant_for_user(request, name)
    try:
        count = pools.step_pool(
            tenant, pool, delta, actor_of(request), reason=request.POST.get("reason", "")
        )
    except pools.FleetLimitError as exc:
        raise _refused(tenant, exc) from None
    return action_done(
        request,
        f"{tenant.name}: pool {pool} desired_count {count - delta} → {count}",
        back_url(request, tenant),
    )


@console_view(methods=["POST"])
def provision_pool(request: HttpRequest, name: str, pool: str) -> HttpResponse:
    return _step(request, name, pool, +1)


@console_view(methods=["POST"])
def deprovision_pool(request: HttpRequest, name: str, pool: str) -> HttpResponse:
    return _step(request, name, pool, -1)


@console_view(methods=["POST"])
def create_pool(request: HttpRequest, name: str) -> HttpResponse:
    tenant = get_rw_tenant_for_user(request, name)
    pool_name = request.POST.get("name", "").strip()
    try:
        pools.create_pool(
            tenant, actor_of(request), pool_name, _form_labels(request),
            request.POST.get("reason", ""),
        )  # fmt: skip
    except pools.FleetLimitError as exc:
        raise _refused(tenant, exc) from None
    return action_done(
        request, f"{tenant.name}: pool {pool_name} created", back_url(request, tenant)
    )


@console_view(methods=["POST"])
def edit_pool(request: HttpRequest, name: str, pool: str) -> HttpResponse:
    tenant = get_rw_tenant_for_user(request, name)
    try:
        pools.update_pool(tenant, pool, _form_labels(request))
    except pools.FleetLimitError as exc:
        raise _refused(tenant, exc) from None
    return action_done(request, f"{tenant.name}: pool {pool} updated", back_url(request, tenant))


@console_view(methods=["POST"])
def delete_pool(request: HttpRequest, name: str, pool: str) -> HttpResponse:
    tenant = get_rw_tenant_for_user(request, name)
    try:
        pools.delete_pool(tenant, pool, actor_of(request), request.POST.get("reason", ""))
    except pools.FleetLimitError as exc:
        raise _refused(tenant, exc) from None
    return action_done(request, f"{tenant.name}: pool {pool} deleted", back_url(request, tenant))
