"""Per-process delivery counters, shown on ``GET /metrics`` (fleet/api/metrics.py).

Prometheus sums them over the scraped processes.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

DISPATCH_LATENCY = Histogram(
    "cloacina_fleet_dispatch_latency_seconds",
    "Time from a task becoming Ready to its work packet being pushed to an agent's socket.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
RESULTS = Counter(
    "cloacina_fleet_results",
    "Task outcomes reported by agents, by outcome and whether they were applied.",
    ["outcome", "applied"],
)

UNCONFIRMED_LOST = Counter(
    "cloacina_outbox_unconfirmed_lost",
    "Work packets pushed CLOACINA_OUTBOX_MAX_PUSHES times to one agent without a "
    "confirmation, whose run was then declared lost.",
)
