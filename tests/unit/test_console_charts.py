"""The generic SVG line chart behind the health charts (fleet/console/charts.py).

The depth chart built on it keeps its own tests in tests/unit/test_console_outbox.py.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from fleet.console.charts import Series, downsample_series, line_chart_svg, tick_label


def _at(minute: int) -> datetime:
    return datetime(2026, 1, 1, 12, 0, tzinfo=UTC) + timedelta(minutes=minute)


def _chart(*series: Series, unit: str = "tasks / min") -> str:
    return line_chart_svg(
        series, _at(0), _at(60), unit=unit, summary="s", css_class="health-chart", data={"x": 1}
    )


def test_it_labels_the_unit_the_legend_and_a_fractional_axis():
    svg = _chart(
        Series("completed", "line-completed", [(_at(0), 0.5), (_at(30), 2.5)]),
        Series("<failed>", "line-failed", [(_at(0), 0.0), (_at(30), 1.0)]),
    )
    assert ">tasks / min</text>" in svg
    assert ">completed</text>" in svg and ">&lt;failed&gt;</text>" in svg
    assert 'class="key line-completed"' in svg and 'class="key line-failed"' in svg
    assert ">5</text>" in svg and ">2.5</text>" in svg and ">0</text>" in svg
    assert 'data-x="1"' in svg
    # The legend is laid out right to left without overlapping: failed's key right of completed's.
    keys = [svg.index('class="key line-completed"'), svg.index('class="key line-failed"')]
    completed_x = float(svg[keys[0] :].split('x1="')[1].split('"')[0])
    failed_x = float(svg[keys[1] :].split('x1="')[1].split('"')[0])
    assert completed_x + 14 + len("completed") * 6 < failed_x


def test_a_gap_breaks_the_line_and_no_data_says_so():
    svg = _chart(Series("p50", "line-p50", [(_at(0), 1.0), (_at(10), None), (_at(20), 2.0)]))
    assert svg.count('class="line-p50" points=') == 0  # two lone points: two dots
    assert svg.count('<circle class="dot line-p50"') == 2
    joined = _chart(Series("p50", "line-p50", [(_at(0), 1.0), (_at(5), 1.5), (_at(10), None),
                                               (_at(20), 2.0), (_at(25), 1.0)]))  # fmt: skip
    assert joined.count('class="line-p50" points=') == 2 and "<circle" not in joined
    empty = _chart(Series("p50", "line-p50", [(_at(0), None)]))
    assert "no samples in this range" in empty and "points=" not in empty


def test_downsampling_a_series_keeps_peaks_and_all_none_buckets():
    points = [(_at(0) + timedelta(seconds=i), 1.0) for i in range(1000)]
    points[500] = (points[500][0], 9.0)
    points[10:20] = [(p[0], None) for p in points[10:20]]
    small = downsample_series(points, 100)
    assert len(small) == 100 and max(v for _, v in small if v is not None) == 9.0
    assert small[1][1] is None  # the bucket of ten Nones stays a gap


def test_tick_labels_are_short():
    assert [tick_label(v) for v in (0, 10, 2.5, 0.25, 1.0)] == ["0", "10", "2.5", "0.25", "1"]
