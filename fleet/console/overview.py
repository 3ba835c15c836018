"""The fleet overview: one live row per tenant the user can see, trouble first.

With hundreds of tenants the rows come a page at a time (``?page=``), narrowed by name
(``?q=``) or by how urgent they are (``?level=``), and sorted (``?sort=``).  The rows of
every visible tenant are computed in a fixed number of grouped queries (fleet_rows), so
the summary still counts every tenant in trouble, not only the ones on this page.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from fleet.console import filters
from fleet.console.access import tenants_for_user, writable_tenant_ids
from fleet.console.fleet_rows import BAD, OK, WARN, TenantRow, tenant_rows
from fleet.console.responses import ConsoleError, console_view

PAGE_SIZE = 50
Q_MAX_CHARS = 100
LEVELS = {"trouble": (WARN, BAD), "bad": (BAD,), "warn": (WARN,), "ok": (OK,)}
SORTS = {
    "trouble": lambda r: (-r.severity, r.tenant.name),
    "name": lambda r: r.tenant.name,
    "backlog": lambda r: (-r.backlog, r.tenant.name),
    "agents": lambda r: (-r.agents_live, r.tenant.name),
}


def _context(request: HttpRequest) -> dict:
    rows = tenant_rows(tenants_for_user(request.user), writable_tenant_ids(request.user))
    level = filters.choice_filter(request, "level", list(LEVELS))
    sort = filters.choice_filter(request, "sort", list(SORTS)) or "trouble"
    q = request.GET.get("q", "").strip()
    if len(q) > Q_MAX_CHARS:
        raise ConsoleError(f"q must be at most {Q_MAX_CHARS} characters")
    shown = _narrowed(rows, q, level)
    shown.sort(key=SORTS[sort])
    number = filters.page_number(request)
    pages = max(1, -(-len(shown) // PAGE_SIZE))
    number = min(number, pages)  # the list shrank under a polled page: its last page
    return {
        "rows": shown[(number - 1) * PAGE_SIZE : number * PAGE_SIZE],
        "tenants_total": len(rows),
        "shown_total": len(shown),
        "troubled": sum(1 for r in rows if r.problems),
        "page_number": number,
        "pages": pages,
        "query": filters.query_without_page(request),
        "q": q,
        "level": level,
        "sort": sort,
        "levels": list(LEVELS),
        "sorts": list(SORTS),
        "narrowed": bool(q or level),
    }


def _narrowed(rows: list[TenantRow], q: str, level: str) -> list[TenantRow]:
    if q:
        rows = [r for r in rows if q.lower() in r.tenant.name.lower()]
    if level:
        rows = [r for r in rows if r.severity in LEVELS[level]]
    return list(rows)


@console_view()
def overview(request: HttpRequest) -> HttpResponse:
    return render(request, "console/overview.html", _context(request))


@console_view()
def overview_rows(request: HttpRequest) -> HttpResponse:
    """The table body alone, polled by the overview page."""
    return render(request, "console/partials/overview_rows.html", _context(request))
