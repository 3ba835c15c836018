"""Plain formatting the console's views and its template filters share
(fleet/templatetags/console_format.py registers the filters)."""

from __future__ import annotations


def human_seconds(seconds: float) -> str:
    """12.3 → '12s', 200 → '3m', 7200 → '2.0h': short enough for a table cell."""
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
