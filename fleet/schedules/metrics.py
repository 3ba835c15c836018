"""Per-process schedule metrics, shown on ``GET /metrics`` (fleet/api/metrics.py).

Prometheus sums them over the scraped processes: each fire is counted by the one
server whose tick (or run-now request) recorded it.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

FIRE_LAG = Histogram(
    "cloacina_schedule_fire_lag_seconds",
    "Time from a schedule's fire time to the start (creation) of its execution.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 1.5, 2, 3, 5, 10, 30, 60, 300, 3600),
)
FIRES = Counter(
    "cloacina_schedule_fires",
    "Schedule fire times handled, by outcome (started, skipped_overlap, missed, "
    "failed_to_start, manual).",
    ["outcome"],
)
