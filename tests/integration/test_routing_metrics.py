"""Agent-fabric and selector metrics on GET /metrics."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from prometheus_client import REGISTRY

from agents.protocol.triples import host_triple
from fleet.executors.fleet import roster
from fleet.executors.fleet.lifecycle import evict_agent
from fleet.models import ApiKey
from tests.support.keys import bearer
from tests.support.routing import agent, place_root, routed_package

pytestmark = pytest.mark.django_db


def scrape() -> str:
    response = Client().get("/metrics")
    assert response.status_code == 200
    return response.content.decode()


def value(text: str, sample: str) -> float:
    match = re.search(rf"^{re.escape(sample)} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{sample} not in /metrics"
    return float(match.group(1))


def local(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_connections_and_state_changes_are_counted_cluster_wide(tenant, agent_key):
    key = ApiKey.verify(agent_key)
    registered = roster.register(key, roster.Registration("w1", host_triple()))
    grant = roster.open_socket(agent_key, registered.id, "server-a")
    roster.open_socket(agent_key, registered.id, "server-b")  # a reconnect elsewhere
    text = scrape()
    assert value(text, "cloacina_agents_connected") == 1
    assert value(text, "cloacina_agent_connects_total") == 2
    assert value(text, "cloacina_agent_disconnects_total") == 0
    assert value(text, 'cloacina_agent_state_changes_total{from="new",to="live"}') == 1
    # The stale socket's disconnect changes nothing; the current one's is counted.
    assert not roster.close_socket(registered.id, "server-a", grant.generation)
    assert roster.close_socket(registered.id, "server-b", grant.generation + 1)
    roster.heartbeat(tenant.pk, registered.id, draining=True)
    evict_agent(registered.id, "test")
    text = scrape()
    assert value(text, "cloacina_agents_connected") == 0
    assert value(text, "cloacina_agent_disconnects_total") == 1
    assert value(text, 'cloacina_agent_state_changes_total{from="live",to="draining"}') == 1
    assert value(text, 'cloacina_agent_state_changes_total{from="draining",to="dead"}') == 1


def test_rest_heartbeats_are_counted(tenant, agent_key):
    w1 = agent(tenant, "w1")
    before = local("cloacina_agent_heartbeats_total", via="rest")
    Client().post(
        f"/api/v1/agents/{w1.pk}/heartbeat", {}, content_type="application/json",
        **bearer(agent_key),
    )  # fmt: skip
    assert local("cloacina_agent_heartbeats_total", via="rest") == before + 1


def test_selections_are_counted_and_timed(tenant):
    routed_package(tenant, tags=["gpu"])
    routed_package(tenant, workflow="tagless", tags=["tpu"])
    agent(tenant, "g", tags=["gpu"], max_concurrency=1)
    before = {
        "tag": local("cloacina_selector_success_total", step="tag"),
        "free": local("cloacina_selector_failure_total", reason="no_free_agent"),
        "match": local("cloacina_selector_failure_total", reason="no_matching_agent"),
        "full": local("cloacina_agent_backpressure_total", reason="agents_full"),
        "timed": local("cloacina_selector_duration_seconds_count"),
    }
    place_root(tenant)  # takes g's one slot
    place_root(tenant)  # g is full: waits
    place_root(tenant, workflow="tagless")  # nobody has "tpu": fails
    assert local("cloacina_selector_success_total", step="tag") == before["tag"] + 1
    assert local("cloacina_selector_failure_total", reason="no_free_agent") == before["free"] + 1
    assert (
        local("cloacina_selector_failure_total", reason="no_matching_agent") == before["match"] + 1
    )
    assert local("cloacina_agent_backpressure_total", reason="agents_full") == before["full"] + 1
    assert local("cloacina_selector_duration_seconds_count") == before["timed"] + 3
    text = scrape()
    for name in ("cloacina_selector_duration_seconds_bucket", "cloacina_selector_success_total"):
        assert name in text
