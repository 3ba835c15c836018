"""Outbox depth per tenant and state, the oldest pending age, and the SVG depth chart.

Here: the unit tests (no database, socket or process); the rest are in tests/integration/test_console_outbox.py.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from fleet.console.charts import DepthPoint, depth_chart_svg, downsample, nice_ceiling


def _at(minute: int) -> datetime:
    return datetime(2026, 1, 1, 12, 0, tzinfo=UTC) + timedelta(minutes=minute)


def test_the_chart_scales_to_a_readable_ceiling():
    assert [nice_ceiling(v) for v in (0, 1, 3, 7, 12, 180, 501)] == [1, 1, 5, 10, 20, 200, 1000]
    svg = depth_chart_svg(
        [DepthPoint(_at(0), 0, 0), DepthPoint(_at(30), 7, 2), DepthPoint(_at(60), 0, 0)],
        _at(0),
        _at(60),
        "acme",
    )
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert ">10</text>" in svg and ">5</text>" in svg  # y axis 0..10
    assert ">12:00</text>" in svg and ">13:00</text>" in svg
    # The peak sits at 70% of the plot height from the bottom.
    pending = svg.split('class="line-pending" points="')[1].split('"')[0].split()
    ys = [float(p.split(",")[1]) for p in pending]
    assert ys[0] == ys[2] and ys[1] < ys[0]


def test_the_chart_says_when_it_has_nothing_and_escapes_labels():
    svg = depth_chart_svg([], _at(0), _at(60), "<script>")
    assert "no samples in this range" in svg
    assert "<script>" not in svg and "&lt;script&gt;" in svg


def test_downsampling_keeps_every_spike():
    points = [DepthPoint(_at(0) + timedelta(seconds=i), 0, 0) for i in range(5000)]
    points[3333] = DepthPoint(points[3333].at, 42, 0)
    small = downsample(points, 100)
    assert len(small) <= 100
    assert max(p.pending for p in small) == 42
