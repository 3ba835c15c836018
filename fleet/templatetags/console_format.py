"""Template filters the console uses to make numbers readable at a glance."""

from __future__ import annotations

from datetime import datetime

from django import template
from django.utils import timezone

register = template.Library()


def _human_seconds(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f}m"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.0f}d"


@register.filter
def seconds(value: float | int | None) -> str:
    """12.3 → '12s'; None → '—'."""
    if value is None:
        return "—"
    return _human_seconds(float(value))


@register.filter
def age(value: datetime | None) -> str:
    """How long ago ``value`` was: '4.2s', '3m', '1.5h'; None → '—'."""
    if value is None:
        return "—"
    return _human_seconds((timezone.now() - value).total_seconds())


@register.filter
def pct(value: float | None) -> str:
    """0.834 → '83%'; None → '—'."""
    if value is None:
        return "—"
    return f"{float(value) * 100:.0f}%"


@register.filter
def short_id(value: object) -> str:
    return str(value)[:8]
