"""The tenant page's health charts: is it healthy, at a glance?

Four charts over the chosen range, from the persisted samples: outbox depth (as on the
outbox page), tasks completed and failed per minute, Ready→started latency p50/p95, and
live agents against desired_count.  Samples are written by
:mod:`fleet.control.health_samples` (one a minute) and
:mod:`fleet.executors.fleet.delivery.depth` (every 10 s).
"""

from __future__ import annotations

from datetime import datetime
from urllib.parse import urlencode

from django.http import HttpRequest
from django.utils import timezone
from django.utils.safestring import SafeString

from fleet.console import filters
from fleet.console.charts import Series, line_chart_svg, tick_label
from fleet.console.outbox import depth_by_tenant, depth_charts
from fleet.models import Tenant, TenantHealthSample

DEFAULT_RANGE = "1h"
# Latency reads in milliseconds until its axis would pass this many of them.
MS_UP_TO = 2000


def health_context(request: HttpRequest, tenant: Tenant) -> dict:
    """The health partial's context: the range picker's state and the four charts."""
    window = filters.time_window(request, DEFAULT_RANGE)
    now = timezone.now()
    until = window.until or now
    rows = TenantHealthSample.objects.filter(tenant=tenant, at__lte=until)
    if window.since:
        rows = rows.filter(at__gte=window.since)
    samples = list(
        rows.order_by("at").values_list(
            "at", "window_s", "completed", "failed", "latency_p50_s", "latency_p95_s",
            "agents_live", "desired_count",
        )
    )  # fmt: skip
    since = window.since or (samples[0][0] if samples else now)
    [depth] = depth_charts(depth_by_tenant([tenant]), window)
    return {
        "health_window": window,
        # The polled partial keeps the page's range (or custom since/until).
        "health_query": urlencode(
            [(k, request.GET[k]) for k in ("range", "since", "until") if request.GET.get(k)]
        ),
        "health_ranges": list(filters.RANGES),
        "health_charts": [
            {"key": "depth", "title": "Outbox depth", "svg": depth["svg"]},
            {"key": "throughput", "title": "Tasks per minute", "svg": throughput_chart(samples, since, until, tenant.name)},
            {"key": "latency", "title": "Ready → started latency", "svg": latency_chart(samples, since, until, tenant.name)},
            {"key": "agents", "title": "Agents", "svg": agents_chart(samples, since, until, tenant.name)},
        ],
    }  # fmt: skip


def per_minute(count: int, window_s: float) -> float:
    return round(count * 60.0 / window_s, 2) if window_s > 0 else 0.0


def throughput_chart(
    samples: list[tuple], since: datetime, until: datetime, name: str
) -> SafeString:
    completed = [(s[0], per_minute(s[2], s[1])) for s in samples]
    failed = [(s[0], per_minute(s[3], s[1])) for s in samples]
    c, f = tick(_last(completed)), tick(_last(failed))
    return _health_chart(
        [Series("completed", "line-completed", completed), Series("failed", "line-failed", failed)],
        since, until, "tasks / min",
        f"Tasks of {name}: {c} completed and {f} failed per minute in the last sample",
        {"completed-now": c, "failed-now": f},
    )  # fmt: skip


def latency_chart(samples: list[tuple], since: datetime, until: datetime, name: str) -> SafeString:
    p95s = [s[5] for s in samples if s[5] is not None]
    in_ms = max(p95s, default=0.0) * 1000 <= MS_UP_TO
    scale, unit = (1000.0, "ms") if in_ms else (1.0, "seconds")

    def scaled(value: float | None) -> float | None:
        return None if value is None else round(value * scale, 3)

    p50 = [(s[0], scaled(s[4])) for s in samples]
    p95 = [(s[0], scaled(s[5])) for s in samples]
    last = next((s for s in reversed(samples) if s[4] is not None), None)
    said = (
        f"p50 {tick(scaled(last[4]))} {unit}, p95 {tick(scaled(last[5]))} {unit} in the last "
        "sample with finished tasks"
        if last
        else "no task finished in this range"
    )
    return _health_chart(
        [Series("p50", "line-p50", p50), Series("p95", "line-p95", p95)],
        since, until, unit, f"Ready→started latency of {name}: {said}",
        {"p95-now": tick(scaled(last[5])) if last else ""},
    )  # fmt: skip


def agents_chart(samples: list[tuple], since: datetime, until: datetime, name: str) -> SafeString:
    live = [(s[0], s[6]) for s in samples]
    desired = [(s[0], s[7]) for s in samples]
    n_live, n_desired = _last(live), _last(desired)
    return _health_chart(
        [Series("desired_count", "line-desired", desired), Series("live", "line-live", live)],
        since, until, "agents",
        f"Agents of {name}: {n_live} live of {n_desired} desired in the last sample",
        {"live-now": n_live, "desired-now": n_desired},
    )  # fmt: skip


def _last(points: list[tuple]) -> float:
    return points[-1][1] if points else 0


def _health_chart(
    series: list[Series], since: datetime, until: datetime, unit: str, summary: str, data: dict
) -> SafeString:
    return line_chart_svg(
        series, since, until, unit=unit, summary=summary, css_class="health-chart", data=data
    )


def tick(value: float | None) -> str:
    """A number as the chart's summary says it: 12, 2.5, — for none."""
    return "—" if value is None else tick_label(value)
