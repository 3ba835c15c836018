"""The fleet overview: one live row per tenant the user can see."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from fleet.console.access import tenants_for_user, writable_tenant_ids
from fleet.console.fleet_rows import tenant_rows
from fleet.console.responses import console_view


def _context(request: HttpRequest) -> dict:
    rows = tenant_rows(tenants_for_user(request.user), writable_tenant_ids(request.user))
    return {"rows": rows, "troubled": sum(1 for r in rows if r.problems)}


@console_view()
def overview(request: HttpRequest) -> HttpResponse:
    return render(request, "console/overview.html", _context(request))


@console_view()
def overview_rows(request: HttpRequest) -> HttpResponse:
    """The table body alone, polled by the overview page."""
    return render(request, "console/partials/overview_rows.html", _context(request))
