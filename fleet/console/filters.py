"""Query-string filters shared by the console's list pages (tenant, time range, status, page).

Bad values are refused with a 400 naming the parameter, never silently ignored:
an operator filtering by a typo must not be shown an unfiltered list.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from urllib.parse import urlencode

from django.http import HttpRequest
from django.utils import timezone

from fleet.console.access import get_tenant_for_user
from fleet.console.responses import ConsoleError
from fleet.models import Tenant

RANGES = {
    "15m": timedelta(minutes=15),
    "1h": timedelta(hours=1),
    "6h": timedelta(hours=6),
    "24h": timedelta(hours=24),
    "7d": timedelta(days=7),
    "30d": timedelta(days=30),
    "all": None,
}
PAGE_SIZE = 25


@dataclass
class TimeWindow:
    name: str  # a RANGES key, or "custom"
    since: datetime | None
    until: datetime | None


def tenant_filter(request: HttpRequest) -> Tenant | None:
    """``?tenant=NAME``: a tenant the user can see (404 otherwise), or None for all of them."""
    name = request.GET.get("tenant", "").strip()
    if not name:
        return None
    return get_tenant_for_user(request, name)[0]


def time_window(request: HttpRequest, default: str) -> TimeWindow:
    """``?range=1h`` or ``?since=…&until=…`` (ISO date-times, UTC when no offset is given)."""
    since = _parse_datetime(request.GET.get("since", ""), "since")
    until = _parse_datetime(request.GET.get("until", ""), "until")
    if since or until:
        if since and until and since > until:
            raise ConsoleError("since must not be after until")
        return TimeWindow("custom", since, until)
    name = request.GET.get("range", "").strip() or default
    if name not in RANGES:
        raise ConsoleError(f"range must be one of {', '.join(RANGES)}, got {name!r}")
    span = RANGES[name]
    return TimeWindow(name, timezone.now() - span if span else None, None)


def _parse_datetime(raw: str, field: str) -> datetime | None:
    raw = raw.strip()
    if not raw:
        return None
    try:
        value = datetime.fromisoformat(raw)
    except ValueError:
        raise ConsoleError(
            f"{field} must be a date and time like 2026-01-31T23:00, got {raw!r}"
        ) from None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def choice_filter(request: HttpRequest, param: str, choices: list[str]) -> str:
    value = request.GET.get(param, "").strip()
    if value and value not in choices:
        raise ConsoleError(f"{param} must be one of {', '.join(choices)}, got {value!r}")
    return value


def page_number(request: HttpRequest) -> int:
    raw = request.GET.get("page", "1").strip() or "1"
    try:
        page = int(raw)
    except ValueError:
        page = 0
    if page < 1:
        raise ConsoleError(f"page must be a whole number ≥ 1, got {raw!r}")
    return page


def query_without_page(request: HttpRequest) -> str:
    """The current filters as a query string, for pagination links and the polled partial."""
    return urlencode([(k, v) for k, v in request.GET.items() if k != "page" and v])
