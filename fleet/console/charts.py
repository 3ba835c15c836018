"""Server-rendered SVG line charts (no chart library, no JavaScript).

Two users: the outbox depth chart (a wedged delivery shows as a pending line that
climbs or stays flat above zero while the delivered line does not move) and the
tenant health charts (tasks per minute, Ready→started latency, agents against
desired_count).  Every chart carries its y axis with a unit, a time axis and a
legend inside the SVG, so a screenshot of it alone still reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

WIDTH, HEIGHT = 640, 170
LEFT, RIGHT, TOP, BOTTOM = 44, 12, 22, 26  # margins for the axis labels and the legend
MAX_POINTS = 320  # more than one point per ~2 px adds nothing but bytes
LEGEND_KEY_W = 14  # px of coloured line before each legend label
CHAR_W = 6  # px per character of a 10 px label, to lay the legend out from the right


@dataclass(frozen=True)
class DepthPoint:
    at: datetime
    pending: int
    delivered: int


@dataclass(frozen=True)
class Series:
    """One line: its legend label, its CSS class (the colour) and (time, value) points.

    A value of None is a gap (no data for that sample), drawn as a break in the line.
    """

    label: str
    css_class: str
    points: Sequence[tuple[datetime, float | None]]


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


def downsample_series(
    points: Sequence[tuple[datetime, float | None]], limit: int = MAX_POINTS
) -> list[tuple[datetime, float | None]]:
    """As :func:`downsample` for one series: each bucket's peak (None only if all are None)."""
    if len(points) <= limit:
        return list(points)
    size = -(-len(points) // limit)
    result: list[tuple[datetime, float | None]] = []
    for start in range(0, len(points), size):
        bucket = points[start : start + size]
        values = [v for _, v in bucket if v is not None]
        result.append((bucket[-1][0], max(values) if values else None))
    return result


def nice_ceiling(value: float) -> float:
    """1, 2, 5, 10, 20, 50, … at or above ``value`` (at least 1), for a readable y axis."""
    step = 1
    while True:
        for factor in (1, 2, 5):
            if step * factor >= value:
                return max(1, step * factor)
        step *= 10


def tick_label(value: float) -> str:
    """A y-axis number as short as it reads: 10, 2.5, 0.25."""
    return f"{value:.2f}".rstrip("0").rstrip(".") if value != int(value) else str(int(value))


def depth_chart_svg(
    points: Sequence[DepthPoint], since: datetime, until: datetime, label: str
) -> SafeString:
    """An SVG line chart of pending and delivered depth between ``since`` and ``until``."""
    points = downsample(sorted(points, key=lambda p: p.at))
    now_pending = points[-1].pending if points else 0
    peak = max((p.pending for p in points), default=0)
    return line_chart_svg(
        [
            Series("delivered", "line-delivered", [(p.at, p.delivered) for p in points]),
            Series("pending", "line-pending", [(p.at, p.pending) for p in points]),
        ],
        since,
        until,
        unit="packets",
        summary=f"Outbox depth of {label}: {now_pending} pending now, peak {peak} in this range",
        css_class="depth-chart",
        data={"pending-now": now_pending},
    )


def line_chart_svg(
    series: Sequence[Series],
    since: datetime,
    until: datetime,
    *,
    unit: str,
    summary: str,
    css_class: str,
    data: dict[str, object] | None = None,
) -> SafeString:
    """An SVG chart of ``series`` between ``since`` and ``until``, y from 0 to a round ceiling.

    ``summary`` is the accessible name and tooltip (what the chart says in one sentence);
    ``data`` becomes ``data-*`` attributes, for tests and scripts reading the latest values.
    """
    series = [
        Series(s.label, s.css_class, downsample_series(sorted(s.points, key=lambda p: p[0])))
        for s in series
    ]
    values = [v for s in series for _, v in s.points if v is not None]
    top = nice_ceiling(max(values, default=0))
    span_s = max((until - since).total_seconds(), 1.0)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(at: datetime) -> float:
        return LEFT + plot_w * min(max((at - since).total_seconds() / span_s, 0.0), 1.0)

    def y(value: float) -> float:
        return TOP + plot_h * (1 - value / top)

    attrs = "".join(f' data-{k}="{escape(v)}"' for k, v in (data or {}).items())
    parts = [
        f'<svg class="{css_class}" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
        f'role="img" aria-label="{escape(summary)}"{attrs}>',
        f"<title>{escape(summary)}</title>",
        f'<text class="axis unit" x="4" y="{TOP - 8}">{escape(unit)}</text>',
    ]
    for value in (0, top / 2, top) if top > 1 else (0, top):
        parts.append(
            f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(value):.1f}" y2="{y(value):.1f}"/>'
            f'<text class="axis" x="{LEFT - 6}" y="{y(value) + 4:.1f}" text-anchor="end">'
            f"{tick_label(value)}</text>"
        )
    for fraction, anchor in ((0.0, "start"), (0.5, "middle"), (1.0, "end")):
        at = since + (until - since) * fraction
        parts.append(
            f'<text class="axis" x="{LEFT + plot_w * fraction:.1f}" y="{HEIGHT - 8}" '
            f'text-anchor="{anchor}">{at:%H:%M}</text>'
        )
    parts.extend(_legend(series))
    if values:
        for s in series:
            for run in _runs(s.points):
                if len(run) == 1:  # a lone point draws no line: mark it
                    at, v = run[0]
                    parts.append(
                        f'<circle class="dot {s.css_class}" cx="{x(at):.1f}" cy="{y(v):.1f}" r="2.5"/>'
                    )
                    continue
                line = " ".join(f"{x(at):.1f},{y(v):.1f}" for at, v in run)
                parts.append(f'<polyline class="{s.css_class}" points="{line}"/>')
    else:
        parts.append(
            f'<text class="empty" x="{LEFT + plot_w / 2:.1f}" y="{TOP + plot_h / 2:.1f}" '
            f'text-anchor="middle">no samples in this range</text>'
        )
    parts.append("</svg>")
    return mark_safe("".join(parts))  # every interpolated value is a number or escaped


def _legend(series: Sequence[Series]) -> list[str]:
    """Keys laid out right to left along the top edge, in the series' order."""
    parts, right = [], WIDTH - RIGHT
    for s in reversed(series):
        text_x = right - len(s.label) * CHAR_W
        key_x = text_x - LEGEND_KEY_W - 4
        parts.append(
            f'<line class="key {s.css_class}" x1="{key_x}" x2="{key_x + LEGEND_KEY_W}" '
            f'y1="{TOP - 12}" y2="{TOP - 12}"/>'
            f'<text class="axis legend-label" x="{text_x}" y="{TOP - 8}">{escape(s.label)}</text>'
        )
        right = key_x - 12
    return parts


def _runs(points: Sequence[tuple[datetime, float | None]]) -> list[list[tuple[datetime, float]]]:
    """The series split at its gaps: each run is drawn as its own polyline."""
    runs: list[list[tuple[datetime, float]]] = [[]]
    for at, value in points:
        if value is None:
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append((at, value))
    return [run for run in runs if run]
