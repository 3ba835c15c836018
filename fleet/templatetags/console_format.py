"""Template filters the console uses to make numbers readable at a glance."""

from __future__ import annotations

from datetime import datetime
from functools import lru_cache

from django import template
from django.urls import get_script_prefix, get_urlconf, reverse
from django.utils import timezone

from fleet.api.error_status import http_status
from fleet.console.formatting import human_seconds

register = template.Library()

# How often live partials poll.  A module constant so the browser tests can
# shorten it for their live server (they patch it) without a setting.
POLL_INTERVAL_S = 2.0


@register.simple_tag
def poll_every() -> str:
    """The htmx polling trigger of live partials: ``every 2s``."""
    return f"every {POLL_INTERVAL_S:g}s"


@register.simple_tag
def tenant_url(view: str, tenant_name: str) -> str:
    """``{% url view tenant_name %}``, remembered: the overview's rows need five links each,
    and reversing them anew every row was a third of the page's template time."""
    return _tenant_url(get_script_prefix(), get_urlconf(), view, tenant_name)


@lru_cache(maxsize=8192)
def _tenant_url(prefix: str, urlconf: str | None, view: str, tenant_name: str) -> str:
    # The prefix and the URLconf are part of the key: reverse() depends on both.
    return reverse(view, urlconf=urlconf, args=[tenant_name])


@register.filter
def seconds(value: float | int | None) -> str:
    """12.3 → '12s'; None → '—'."""
    if value is None:
        return "—"
    return human_seconds(float(value))


@register.filter
def age(value: datetime | None) -> str:
    """How long ago ``value`` was: '4.2s', '3m', '1.5h'; None → '—'."""
    if value is None:
        return "—"
    return human_seconds((timezone.now() - value).total_seconds())


@register.filter
def span(start: datetime | None, end: datetime | None) -> str:
    """The time from ``start`` to ``end`` ('45s', '3m'); '—' if either is missing."""
    if start is None or end is None:
        return "—"
    return human_seconds((end - start).total_seconds())


@register.filter
def pct(value: float | None) -> str:
    """0.834 → '83%'; None → '—'."""
    if value is None:
        return "—"
    return f"{float(value) * 100:.0f}%"


@register.filter
def short_id(value: object) -> str:
    return str(value)[:8]


@register.filter(name="http_status")
def http_status_of(kind: str) -> int:
    """A failed build's error kind → the HTTP status the API shows for it ('too_large' → 413)."""
    return http_status(kind)
