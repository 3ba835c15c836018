"""Prometheus metrics (GET /metrics).

The fleet's totals must agree whichever server process is scraped, so they
are computed from the database at scrape time by :class:`FleetCollector`:
evictions (Eviction rows), reassigned work (their ``reassigned`` sum), open
outbox rows (not acked), live agents per tenant and their load (slots busy and
slots in all, and agents counted by utilisation bucket).  Per-process figures —
dispatch latency (Ready → delivered to the agent's socket) and results by
outcome — are ordinary prometheus_client metrics that Prometheus sums over
the scraped processes, like the connection pool's (``cloacina_db_pool_*``), and
so are each registered executor's own figures (``cloacina_executor_*{executor}``).
"""

from __future__ import annotations

import hmac
import logging

from django.db import DatabaseError, connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# The delivery counters and the agent-fabric and selector metrics (agents connected, connects, state changes,
# heartbeats, back-pressure, selection) register themselves on import.
from fleet.engine.dispatcher import Dispatcher
from fleet.executors.fleet.delivery import metrics as delivery_metrics  # noqa: F401
from fleet.executors.fleet.routing import metrics as routing_metrics  # noqa: F401
from fleet.executors.fleet.state import ledger
from fleet.platform.config import get_config
from fleet.platform.db_pool import PoolCollector
from fleet.schedules import metrics as schedule_metrics  # noqa: F401 (registers on import)

log = logging.getLogger(__name__)


class FleetCollector(Collector):
    """Cluster-wide fleet figures read from the database on every scrape."""

    def describe(self):
        # Without describe() the registry would call collect() (a query) at import time.
        yield CounterMetricFamily("cloacina_fleet_agents_evicted", "")
        yield CounterMetricFamily("cloacina_fleet_work_reassigned", "")
        yield GaugeMetricFamily("cloacina_delivery_outbox_open", "")
        yield GaugeMetricFamily("cloacina_fleet_agents_live", "", labels=["tenant"])
        yield GaugeMetricFamily("cloacina_fleet_agents_load", "", labels=["tenant", "load"])
        yield GaugeMetricFamily("cloacina_fleet_slots_busy", "", labels=["tenant"])
        yield GaugeMetricFamily("cloacina_fleet_slots", "", labels=["tenant"])

    def collect(self):
        try:
            with connection.cursor() as cursor:
                cursor.execute(
                    f"""
                    SELECT (SELECT count(*) FROM fleet_eviction),
                           (SELECT coalesce(sum(reassigned), 0) FROM fleet_eviction),
                           (SELECT count(*) FROM {ledger.OUTBOX} o WHERE {ledger.open_row("o")})
                    """
                )
                evicted, reassigned, open_rows = cursor.fetchone()
                cursor.execute(_LOAD)
                load = cursor.fetchall()
        except DatabaseError as exc:
            log.warning("fleet metrics unavailable: %s", exc)
            return
        yield CounterMetricFamily(
            "cloacina_fleet_agents_evicted",
            "Agents the liveness sweeper (or a replacing registration) declared dead.",
            value=evicted,
        )
        yield CounterMetricFamily(
            "cloacina_fleet_work_reassigned",
            "In-flight outbox rows reclaimed from dead agents onto survivors.",
            value=int(reassigned),
        )
        yield GaugeMetricFamily(
            "cloacina_delivery_outbox_open",
            "Outbox rows not yet acked (pending or delivered): the depth of the push queue.",
            value=open_rows,
        )
        yield from _load_families(load)


# Live agents by in_flight / max_concurrency, one row per tenant and bucket (the
# buckets of LOAD_BUCKETS, in that order).  Integer comparisons: no division, and an
# agent with max_concurrency 0 counts as full.
_LOAD = f"""
    SELECT t.name,
           count(a.id) FILTER (WHERE a.in_flight < 1 AND a.max_concurrency > 0),
           count(a.id) FILTER (WHERE a.in_flight > 0 AND a.in_flight * 4 < a.max_concurrency),
           count(a.id) FILTER (WHERE a.in_flight * 4 >= a.max_concurrency
                                 AND a.in_flight * 2 < a.max_concurrency AND a.in_flight > 0),
           count(a.id) FILTER (WHERE a.in_flight * 2 >= a.max_concurrency
                                 AND a.in_flight * 4 < a.max_concurrency * 3 AND a.in_flight > 0),
           count(a.id) FILTER (WHERE a.in_flight * 4 >= a.max_concurrency * 3
                                 AND a.in_flight < a.max_concurrency AND a.in_flight > 0),
           count(a.id) FILTER (WHERE a.in_flight >= a.max_concurrency),
           coalesce(sum(LEAST(a.in_flight, a.max_concurrency)), 0),
           coalesce(sum(a.max_concurrency), 0)
    FROM fleet_tenant t
    LEFT JOIN {ledger.AGENTS} a ON a.tenant_id = t.id AND a.state = 'live'
    GROUP BY t.name ORDER BY t.name
"""
# Every tenant gets all six series, so the cardinality is exactly 6 × tenants whatever
# the number of agents: no series is ever labelled by an agent.
LOAD_BUCKETS = ("idle", "under_25", "under_50", "under_75", "under_100", "full")


def _load_families(rows: list[tuple]) -> list[GaugeMetricFamily]:
    """The live agents per tenant (the buckets partition them, so their sum), by bucket, and
    their slots: every figure from the one per-scrape query."""
    live = GaugeMetricFamily(
        "cloacina_fleet_agents_live", "Live agents per tenant.", labels=["tenant"]
    )
    by_bucket = GaugeMetricFamily(
        "cloacina_fleet_agents_load",
        "Live agents per tenant by slots in use / max_concurrency: idle (0), under_25, "
        "under_50, under_75, under_100 (busy but not full) and full.",
        labels=["tenant", "load"],
    )
    busy = GaugeMetricFamily(
        "cloacina_fleet_slots_busy",
        "Slots in use on the tenant's live agents (in_flight, at most max_concurrency each).",
        labels=["tenant"],
    )
    slots = GaugeMetricFamily(
        "cloacina_fleet_slots",
        "Slots in all on the tenant's live agents (the sum of max_concurrency).",
        labels=["tenant"],
    )
    for tenant, *counts in rows:
        buckets = counts[: len(LOAD_BUCKETS)]
        live.add_metric([tenant], sum(buckets))
        for bucket, count in zip(LOAD_BUCKETS, buckets, strict=True):
            by_bucket.add_metric([tenant, bucket], count)
        busy.add_metric([tenant], int(counts[-2]))
        slots.add_metric([tenant], int(counts[-1]))
    return [live, by_bucket, busy, slots]


class ExecutorCollector(Collector):
    """Every registered executor's own figures (``TaskExecutor.metrics()``), by executor key.

    Per process, like the dispatch latency: each server reports the executors it built.
    ``metrics()`` reads in-memory counters, so a scrape costs no query whatever the load.
    """

    def __init__(self) -> None:
        self.dispatcher: Dispatcher | None = None

    def describe(self):
        for name, kind in EXECUTOR_FAMILIES:
            yield kind(name, "", labels=["executor"])

    def collect(self):
        dispatcher = self.dispatcher
        if dispatcher is None:
            return
        families = {
            name: kind(name, help_text, labels=["executor"])
            for (name, kind), help_text in zip(EXECUTOR_FAMILIES, EXECUTOR_HELP, strict=True)
        }
        for key, executor in sorted(dispatcher.registered().items()):
            try:
                figures = executor.metrics()
            except Exception:  # one executor's bug must not blank the whole scrape
                log.exception("executor %r metrics unavailable", key)
                continue
            values = (
                figures.active_tasks,
                figures.max_concurrent,
                figures.total_executed,
                figures.total_failed,
                figures.avg_duration_ms,
                1 if key == dispatcher.default_key else 0,
            )
            for (name, _kind), value in zip(EXECUTOR_FAMILIES, values, strict=True):
                families[name].add_metric([key], value)
        yield from families.values()


EXECUTOR_FAMILIES = (
    ("cloacina_executor_active_tasks", GaugeMetricFamily),
    ("cloacina_executor_capacity", GaugeMetricFamily),
    ("cloacina_executor_tasks_executed", CounterMetricFamily),
    ("cloacina_executor_tasks_failed", CounterMetricFamily),
    ("cloacina_executor_avg_duration_ms", GaugeMetricFamily),
    ("cloacina_executor_selected", GaugeMetricFamily),
)
EXECUTOR_HELP = (
    "Tasks the executor is running now (ExecutorMetrics.active_tasks).",
    "Tasks the executor could run at once (ExecutorMetrics.max_concurrent).",
    "Runs the executor finished, whatever the outcome (ExecutorMetrics.total_executed).",
    "Finished runs that failed or timed out (ExecutorMetrics.total_failed).",
    "Mean duration of the finished runs, in milliseconds (ExecutorMetrics.avg_duration_ms).",
    "1 for the executor every task goes to (default_executor), 0 for the others.",
)


def watch_executors(dispatcher: Dispatcher | None) -> None:
    """Report ``dispatcher``'s executors on /metrics (`serve` calls it once it is built);
    None stops reporting them."""
    _executors.dispatcher = dispatcher


_collector = FleetCollector()
_executors = ExecutorCollector()
REGISTRY.register(_collector)
REGISTRY.register(_executors)
REGISTRY.register(PoolCollector())


def metrics_view(request: HttpRequest) -> HttpResponse:
    """The scrape; with CLOACINA_METRICS_TOKEN set, only for ``Authorization: Bearer <it>``."""
    refusal = _token_refusal(request, get_config().metrics_token)
    if refusal is not None:
        return refusal
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)


def _token_refusal(request: HttpRequest, token: str) -> HttpResponse | None:
    if not token:
        return None  # not configured: open, as before (bind to a private interface)
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
        return None
    response = JsonResponse(
        {"detail": "/metrics needs Authorization: Bearer <CLOACINA_METRICS_TOKEN>"}, status=401
    )
    response["WWW-Authenticate"] = 'Bearer realm="metrics"'
    return response
