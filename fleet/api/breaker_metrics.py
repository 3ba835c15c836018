"""Circuit breakers on ``GET /metrics``: live agents per tenant by breaker state.

A gauge with bounded cardinality (3 series per tenant, never one per agent), read from
the database at scrape time so every server process answers the same.  The trips
counter (``cloacina_fleet_breaker_trips_total{cause}``) is per process and registered
by :mod:`fleet.executors.fleet.state.breaker`.
"""

from __future__ import annotations

import logging

from django.db import DatabaseError, connection
from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from fleet.executors.fleet.state import breaker, ledger

log = logging.getLogger(__name__)

_BY_STATE = f"""
    SELECT t.name,
           count(a.id) FILTER (WHERE a.breaker_open_until IS NULL),
           count(a.id) FILTER (WHERE a.breaker_open_until > now()),
           count(a.id) FILTER (WHERE a.breaker_open_until <= now())
    FROM fleet_tenant t
    LEFT JOIN {ledger.AGENTS} a ON a.tenant_id = t.id AND a.state = 'live'
    GROUP BY t.name ORDER BY t.name
"""
STATES = (breaker.BreakerState.CLOSED, breaker.BreakerState.OPEN, breaker.BreakerState.HALF_OPEN)


class BreakerCollector(Collector):
    def describe(self):
        # Without describe() the registry would call collect() (a query) at import time.
        yield GaugeMetricFamily("cloacina_fleet_agents_breaker", "", labels=["tenant", "state"])

    def collect(self):
        try:
            with connection.cursor() as cursor:
                cursor.execute(_BY_STATE)
                rows = cursor.fetchall()
        except DatabaseError as exc:
            log.warning("breaker metrics unavailable: %s", exc)
            return
        family = GaugeMetricFamily(
            "cloacina_fleet_agents_breaker",
            "Live agents per tenant by circuit-breaker state: closed, open (no new work), "
            "half_open (one probe task may be placed).",
            labels=["tenant", "state"],
        )
        for tenant, *counts in rows:
            for state, count in zip(STATES, counts, strict=True):
                family.add_metric([tenant, state.value], count)
        yield family


REGISTRY.register(BreakerCollector())
