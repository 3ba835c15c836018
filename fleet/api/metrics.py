"""Prometheus metrics (GET /metrics).

The fleet's totals must agree whichever server process is scraped, so they
are computed from the database at scrape time by :class:`FleetCollector`:
evictions (Eviction rows), reassigned work (their ``reassigned`` sum), open
outbox rows (not acked) and live agents per tenant.  Per-process figures —
dispatch latency (Ready → delivered to the agent's socket) and results by
outcome — are ordinary prometheus_client metrics that Prometheus sums over
the scraped processes, like the connection pool's (``cloacina_db_pool_*``).
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
from fleet.executors.fleet.delivery import metrics as delivery_metrics  # noqa: F401
from fleet.executors.fleet.routing import metrics as routing_metrics  # noqa: F401
from fleet.executors.fleet.state import ledger
from fleet.platform.config import get_config
from fleet.platform.db_pool import PoolCollector

log = logging.getLogger(__name__)


class FleetCollector(Collector):
    """Cluster-wide fleet figures read from the database on every scrape."""

    def describe(self):
        # Without describe() the registry would call collect() (a query) at import time.
        yield CounterMetricFamily("cloacina_fleet_agents_evicted", "")
        yield CounterMetricFamily("cloacina_fleet_work_reassigned", "")
        yield GaugeMetricFamily("cloacina_delivery_outbox_open", "")
        yield GaugeMetricFamily("cloacina_fleet_agents_live", "", labels=["tenant"])

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
                cursor.execute(
                    f"""
                    SELECT t.name, count(a.id) FROM fleet_tenant t
                    LEFT JOIN {ledger.AGENTS} a ON a.tenant_id = t.id AND a.state = 'live'
                    GROUP BY t.name ORDER BY t.name
                    """
                )
                live = cursor.fetchall()
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
        agents = GaugeMetricFamily(
            "cloacina_fleet_agents_live", "Live agents per tenant.", labels=["tenant"]
        )
        for tenant, count in live:
            agents.add_metric([tenant], count)
        yield agents


_collector = FleetCollector()
REGISTRY.register(_collector)
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
