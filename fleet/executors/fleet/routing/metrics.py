"""Agent-fabric and selector metrics, beside the fleet's (``GET /metrics``).

Cluster-wide figures come from the database at scrape time, so every server process
answers the same: agents connected (gauge) and the event counters a trigger keeps on
``agents_agent`` (connects, disconnects, state changes from → to; migration
fleet/0006).  Per-process figures are ordinary prometheus_client metrics that
Prometheus sums over the processes: heartbeats received, back-pressure events,
outbound channel-full events, selection duration and selection outcomes.
"""

from __future__ import annotations

import logging

from django.db import DatabaseError, connection
from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from fleet.executors.fleet.state import ledger

log = logging.getLogger(__name__)

HEARTBEATS = Counter(
    "cloacina_agent_heartbeats",
    "Agent heartbeats received by this process, by transport (socket or rest).",
    ["via"],
)
BACKPRESSURE = Counter(
    "cloacina_agent_backpressure",
    "Times work had to wait because every agent that could take it was at capacity.",
    ["reason"],
)
SELECTION_DURATION = Histogram(
    "cloacina_selector_duration_seconds",
    "Time to choose an agent for a task and reserve its slot (or find there is none).",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
SELECTION_SUCCESS = Counter(
    "cloacina_selector_success",
    "Tasks given an agent, by the selection step that decided (direct, tag, capability, "
    "gpu, resources, fallback, group, affinity).",
    ["step"],
)
SELECTION_FAILURE = Counter(
    "cloacina_selector_failure",
    "Selections that found no agent, by reason: no_free_agent (the task waits), "
    "no_matching_agent / invalid_selector / context_too_large (the task fails).",
    ["reason"],
)


def observe_selections(seconds: float, tasks: int) -> None:
    """Record a batch statement that selected agents for ``tasks`` tasks in ``seconds``.

    The single path observes once per task (``selection.select``), so the batch path does
    too: one observation per task, each the statement's time shared evenly, so the
    histogram's count is still the number of tasks selected and its sum the time spent.
    """
    if tasks <= 0:
        return
    share = seconds / tasks
    for _ in range(tasks):
        SELECTION_DURATION.observe(share)


class AgentFabricCollector(Collector):
    def describe(self):
        # Without describe() the registry would call collect() (a query) at import time.
        yield GaugeMetricFamily("cloacina_agents_connected", "")
        yield CounterMetricFamily("cloacina_agent_connects", "")
        yield CounterMetricFamily("cloacina_agent_disconnects", "")
        yield CounterMetricFamily("cloacina_agent_state_changes", "", labels=["from", "to"])

    def collect(self):
        try:
            with connection.cursor() as cursor:
                cursor.execute(
                    f"SELECT count(*) FROM {ledger.AGENTS} WHERE connected_to <> '' AND state IN ('live', 'draining')"
                )
                connected = cursor.fetchone()[0]
                cursor.execute(
                    "SELECT kind, from_state, to_state, count FROM fleet_agenteventcount"
                    " ORDER BY kind, from_state, to_state"
                )
                events = cursor.fetchall()
        except DatabaseError as exc:
            log.warning("agent metrics unavailable: %s", exc)
            return
        yield GaugeMetricFamily(
            "cloacina_agents_connected",
            "Agents holding a delivery socket to some server process.",
            value=connected,
        )
        totals = {"connect": 0, "disconnect": 0}
        changes = CounterMetricFamily(
            "cloacina_agent_state_changes",
            "Agent state transitions (from → to; 'new' is a registration), cluster-wide.",
            labels=["from", "to"],
        )
        for kind, from_state, to_state, count in events:
            if kind == "state_change":
                changes.add_metric([from_state, to_state], count)
            elif kind in totals:
                totals[kind] += count
        yield CounterMetricFamily(
            "cloacina_agent_connects",
            "Delivery sockets opened by agents (each one bumps the connection generation).",
            value=totals["connect"],
        )
        yield CounterMetricFamily(
            "cloacina_agent_disconnects",
            "Delivery sockets lost or closed (a stale socket superseded by a newer one is not counted).",
            value=totals["disconnect"],
        )
        yield changes


REGISTRY.register(AgentFabricCollector())
