"""Server-rendered SVG of outbox depth over time (no chart library, no JavaScript).

A wedged delivery shows as a pending line that climbs or stays flat above
zero while the delivered line does not move.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

WIDTH, HEIGHT = 640, 170
LEFT, RIGHT, TOP, BOTTOM = 44, 12, 14, 26  # margins for the axis labels
MAX_POINTS = 320  # more than one point per ~2 px adds nothing but bytes


@dataclass(frozen=True)
class DepthPoint:
    at: datetime
    pending: int
    delivered: int


def downsample(points: Sequence[DepthPoint], limit: int = MAX_POINTS) -> list[DepthPoint]:
    """At most ``limit`` points, keeping each bucket's peak so a spike never disappears."""
    if len(points) <= limit:
        return list(points)
    size = -(-len(points) // limit)
    result = []
    for start in range(0, len(points), size):
        bucket = points[start : start + size]
        result.append(
            DepthPoint(
                at=bucket[-1].at,
                pending=max(p.pending for p in bucket),
                delivered=max(p.delivered for p in bucket),
            )
        )
    return result


def nice_ceiling(value: int) -> int:
    """1, 2, 5, 10, 20, 50, … at or above ``value`` (at least 1), for a readable y axis."""
    step = 1
    while True:
        for factor in (1, 2, 5):
            if step * factor >= value:
                return max(1, step * factor)
        step *= 10


def depth_chart_svg(
    points: Sequence[DepthPoint], since: datetime, until: datetime, label: str
) -> SafeString:
    """An SVG line chart of pending and delivered depth between ``since`` and ``until``."""
    points = downsample(sorted(points, key=lambda p: p.at))
    span_s = max((until - since).total_seconds(), 1.0)
    top = nice_ceiling(max([p.pending for p in points] + [p.delivered for p in points] + [1]))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(at: datetime) -> float:
        return LEFT + plot_w * min(max((at - since).total_seconds() / span_s, 0.0), 1.0)

    def y(value: int) -> float:
        return TOP + plot_h * (1 - value / top)

    def line(attr: str) -> str:
        return " ".join(f"{x(p.at):.1f},{y(getattr(p, attr)):.1f}" for p in points)

    now_pending = points[-1].pending if points else 0
    peak = max((p.pending for p in points), default=0)
    summary = f"Outbox depth of {label}: {now_pending} pending now, peak {peak} in this range"
    parts = [
        f'<svg class="depth-chart" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
        f'role="img" aria-label="{escape(summary)}" data-pending-now="{now_pending}">',
        f"<title>{escape(summary)}</title>",
    ]
    for value in (0, top // 2, top) if top > 1 else (0, top):
        parts.append(
            f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(value):.1f}" y2="{y(value):.1f}"/>'
            f'<text class="axis" x="{LEFT - 6}" y="{y(value) + 4:.1f}" text-anchor="end">{value}</text>'
        )
    for fraction, anchor in ((0.0, "start"), (0.5, "middle"), (1.0, "end")):
        at = since + (until - since) * fraction
        parts.append(
            f'<text class="axis" x="{LEFT + plot_w * fraction:.1f}" y="{HEIGHT - 8}" '
            f'text-anchor="{anchor}">{at:%H:%M}</text>'
        )
    if points:
        parts.append(f'<polyline class="line-delivered" points="{line("delivered")}"/>')
        parts.append(f'<polyline class="line-pending" points="{line("pending")}"/>')
    else:
        parts.append(
            f'<text class="empty" x="{LEFT + plot_w / 2:.1f}" y="{TOP + plot_h / 2:.1f}" '
            f'text-anchor="middle">no samples in this range</text>'
        )
    parts.append("</svg>")
    return mark_safe("".join(parts))  # every interpolated value is a number or escaped
