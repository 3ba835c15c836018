"""The agent state machine (issue 15): ``state`` gains ``stopped`` (a clean exit, not a
death), ``phase`` is derived from the row, and every lifecycle transition is counted in
``cloacina_fleet_agent_phase_transitions_total{from,to}`` where it happens."""

from __future__ import annotations

import json
from collections import Counter
from datetime import timedelta

import pytest
from django.utils import timezone
from prometheus_client import REGISTRY

from agents.models import Agent
from fleet.executors.fleet import lifecycle
from fleet.executors.fleet.delivery.placement import reserve_agent
from fleet.models import ApiKey, Eviction
from fleet.platform.config import get_config
from tests.support.agents import make_agent
from tests.support.keys import bearer

SERVER = "server-phases"


def counted() -> Counter:
    """The transitions counter, as {(from, to): value}."""
    found = Counter()
    for metric in REGISTRY.collect():
        if metric.name == "cloacina_fleet_agent_phase_transitions":
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    found[(sample.labels["from"], sample.labels["to"])] = sample.value
    return found


class Transitions:
    """What the counter gained since the last look."""

    def __init__(self) -> None:
        self.seen = counted()

    def new(self) -> dict:
        now = counted()
        gained = {k: v - self.seen[k] for k, v in now.items() if v != self.seen[k]}
        self.seen = now
        return gained


def post(client, path: str, key: str, body: dict | None = None):
    return client.post(
        f"/api/v1{path}", data=json.dumps(body or {}), content_type="application/json",
        **bearer(key),
    )  # fmt: skip


def shown(client, read_key: str, name: str) -> tuple[str, str]:
    """(state, phase) of the agent ``name`` in GET /fleet."""
    body = client.get("/api/v1/fleet", **bearer(read_key)).json()
    [agent] = [a for a in body["agents"] if a["name"] == name]
    return agent["state"], agent["phase"]


def register(client, agent_key: str, name: str, slots: int = 2) -> Agent:
    body = {
        "name": name, "target_triple": "x86_64-unknown-linux-gnu", "max_concurrency": slots,
        "protocol_version": 1, "wire_format": "json",
    }  # fmt: skip
    answer = post(client, "/agents/register", agent_key, body)
    assert answer.status_code == 201, answer.content
    return Agent.objects.get(pk=answer.json()["agent_id"])


def generation(agent: Agent) -> int:
    agent.refresh_from_db()
    return agent.connection_generation


@pytest.mark.django_db
def test_a_clean_life_connecting_ready_busy_disconnected_draining_stopped(
    client, agent_key, read_key, tenant
):
    seen = Transitions()
    agent = register(client, agent_key, "w1")
    assert shown(client, read_key, "w1") == ("live", "connecting")
    assert seen.new() == {("new", "connecting"): 1}

    lifecycle.connect(agent.id, tenant.pk, SERVER)
    assert shown(client, read_key, "w1") == ("live", "ready")
    assert seen.new() == {("connecting", "ready"): 1}

    assert [reserve_agent(tenant.pk).name for _ in range(2)] == ["w1", "w1"]
    assert shown(client, read_key, "w1") == ("live", "busy")  # every slot taken: derived
    assert seen.new() == {}  # ready ⇄ busy follows the slot counter: not counted

    assert lifecycle.disconnect(agent.id, SERVER, generation(agent))
    assert shown(client, read_key, "w1") == ("live", "disconnected")
    assert seen.new() == {("busy", "disconnected"): 1}
    assert not lifecycle.disconnect(agent.id, SERVER, generation(agent))  # already gone
    assert seen.new() == {}

    lifecycle.connect(agent.id, tenant.pk, SERVER)
    assert shown(client, read_key, "w1") == ("live", "busy")
    assert seen.new() == {("disconnected", "busy"): 1}

    lifecycle.request_drain(agent.id, 60, "test")
    assert shown(client, read_key, "w1") == ("draining", "draining")
    assert seen.new() == {("busy", "draining"): 1}

    assert post(client, f"/agents/{agent.id}/deregister", agent_key).status_code == 200
    assert shown(client, read_key, "w1") == ("stopped", "stopped")
    assert seen.new() == {("draining", "stopped"): 1}
    agent.refresh_from_db()
    assert agent.dead_at is not None and agent.connected_to == ""
    assert not Eviction.objects.filter(agent=agent).exists()  # a clean exit is no eviction
    # A stopped agent's name is free again, and registering it anew is a new agent.
    again = register(client, agent_key, "w1")
    assert again.pk != agent.pk
    assert seen.new() == {("new", "connecting"): 1}


@pytest.mark.django_db
def test_a_ready_agent_that_stops_cleanly_is_stopped_not_dead(client, agent_key, read_key, tenant):
    agent = register(client, agent_key, "w2")
    lifecycle.connect(agent.id, tenant.pk, SERVER)
    seen = Transitions()
    assert post(client, f"/agents/{agent.id}/deregister", agent_key).status_code == 200
    assert shown(client, read_key, "w2") == ("stopped", "stopped")
    assert seen.new() == {("ready", "stopped"): 1}
    assert not Eviction.objects.filter(agent=agent).exists()
    # The cluster-wide state-change counter (a trigger) sees it as live → stopped.
    assert (
        'cloacina_agent_state_changes_total{from="live",to="stopped"}'
        in client.get("/metrics").content.decode()
    )


@pytest.mark.django_db
def test_a_silent_agent_is_disconnected_then_dead_after_the_liveness_window(
    client, read_key, tenant
):
    agent = make_agent(tenant, "silent", connected=False, connection_generation=3)
    assert shown(client, read_key, "silent") == ("live", "disconnected")
    seen = Transitions()
    window = get_config().liveness_window_s
    lifecycle.sweep_dead_agents()
    assert shown(client, read_key, "silent") == ("live", "disconnected")  # still inside it
    Agent.objects.filter(pk=agent.pk).update(
        last_heartbeat=timezone.now() - timedelta(seconds=window + 1)
    )
    lifecycle.sweep_dead_agents()
    assert shown(client, read_key, "silent") == ("dead", "dead")
    assert seen.new() == {("disconnected", "dead"): 1}
    assert Eviction.objects.filter(agent=agent).exists()


@pytest.mark.django_db
def test_an_agent_draining_itself_by_heartbeat_then_evicted_past_its_deadline(
    client, read_key, tenant
):
    agent = make_agent(tenant, "leaving")
    seen = Transitions()
    assert lifecycle.beat(tenant.pk, agent.id, None, draining=True)[0] == "draining"
    assert shown(client, read_key, "leaving") == ("draining", "draining")
    assert seen.new() == {("ready", "draining"): 1}
    assert lifecycle.beat(tenant.pk, agent.id, None, draining=True)[0] == "draining"
    assert seen.new() == {}  # already draining
    Agent.objects.filter(pk=agent.pk).update(drain_deadline=timezone.now() - timedelta(seconds=1))
    assert len(lifecycle.evict_overdue_drains()) == 1
    assert shown(client, read_key, "leaving") == ("dead", "dead")
    assert seen.new() == {("draining", "dead"): 1}


@pytest.mark.django_db
def test_a_replaced_registration_dies_and_a_never_connected_one_counts_from_connecting(
    client, agent_key, read_key, tenant
):
    first = register(client, agent_key, "twin")
    seen = Transitions()
    second = register(client, agent_key, "twin")
    first.refresh_from_db()
    assert (first.state, second.state) == ("dead", "live")
    assert seen.new() == {("connecting", "dead"): 1, ("new", "connecting"): 1}


@pytest.mark.django_db
def test_revoking_the_key_retires_its_agents_as_dead(client, agent_key, read_key, tenant):
    agent = register(client, agent_key, "keyed")
    lifecycle.connect(agent.id, tenant.pk, SERVER)
    seen = Transitions()
    agent.refresh_from_db()
    assert lifecycle.revoke_key(ApiKey.objects.get(pk=agent.api_key_id))
    assert shown(client, read_key, "keyed") == ("dead", "dead")
    assert seen.new() == {("ready", "dead"): 1}
