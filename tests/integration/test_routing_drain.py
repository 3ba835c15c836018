"""Drain on request: POST /api/v1/agents/{id}/drain and the console button."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from agents.models import Agent
from fleet.executors.fleet.lifecycle import sweep_dead_agents
from fleet.models import ApiKey, DeliveryOutbox, Eviction, TenantMembership
from tests.support.keys import bearer
from tests.support.routing import agent, place_root, routed_package

pytestmark = pytest.mark.django_db


def drain(client_key: str, agent_id, body: dict | None = None):
    return Client().post(
        f"/api/v1/agents/{agent_id}/drain",
        body if body is not None else {},
        content_type="application/json",
        **bearer(client_key),
    )


def test_a_write_key_drains_its_agent_and_no_new_work_goes_to_it(tenant, write_key, agent_key):
    routed_package(tenant)
    w1 = agent(tenant, "w1", max_concurrency=8)
    agent(tenant, "w2", max_concurrency=8)
    before = timezone.now()
    response = drain(write_key, w1.pk, {"timeout_s": 120})
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["name"], body["state"], body["in_flight"]) == ("w1", "draining", 0)
    w1.refresh_from_db()
    assert w1.state == "draining" and w1.drain_requested_at is not None
    assert timedelta(seconds=119) < w1.drain_deadline - before < timedelta(seconds=121)
    # The agent hears it on its next heartbeat (REST here; the socket sends a drain frame).
    beat = Client().post(
        f"/api/v1/agents/{w1.pk}/heartbeat", {}, content_type="application/json",
        **bearer(agent_key),
    )  # fmt: skip
    assert beat.json() == {"state": "draining", "drain": True}
    assert {place_root(tenant)[0].agent_name for _ in range(3)} == {"w2"}


def test_the_default_timeout_is_the_platforms(tenant, write_key):
    w1 = agent(tenant, "w1")
    before = timezone.now()
    response = Client().post(
        f"/api/v1/agents/{w1.pk}/drain", content_type="application/json", **bearer(write_key)
    )
    assert response.status_code == 200, response.content
    w1.refresh_from_db()
    assert timedelta(seconds=299) < w1.drain_deadline - before < timedelta(seconds=301)


def test_a_second_drain_keeps_the_earlier_deadline(tenant, write_key):
    w1 = agent(tenant, "w1")
    first = drain(write_key, w1.pk, {"timeout_s": 30}).json()["drain_deadline"]
    again = drain(write_key, w1.pk, {"timeout_s": 600})
    assert again.status_code == 200 and again.json()["drain_deadline"] == first


def test_an_admin_key_may_not_drain_an_agent(tenant, admin_key):
    """The admin key is platform-wide and may change a tenant's fleet numbers only
    (docs/threat-model.md): draining one agent of a tenant is its write key's call."""
    w1 = agent(tenant, "w1")
    response = drain(admin_key, w1.pk, {"timeout_s": 5})
    assert (response.status_code, response.json()) == (
        403, {"detail": "a admin key may not call this endpoint (needs write)"},
    )  # fmt: skip
    w1.refresh_from_db()
    assert (w1.state, w1.drain_requested_at, w1.drain_deadline) == ("live", None, None)


def test_refusals(tenant, other_tenant, read_key, agent_key, other_write_key, write_key):
    w1 = agent(tenant, "w1")
    assert drain(read_key, w1.pk).status_code == 403
    assert drain(agent_key, w1.pk).status_code == 403
    other = drain(other_write_key, w1.pk)
    assert (other.status_code, other.json()) == (404, {"detail": "unknown agent"})
    bad = drain(write_key, w1.pk, {"timeout_s": -1})
    assert bad.status_code == 422 and "timeout_s" in bad.content.decode()
    Agent.objects.filter(pk=w1.pk).update(state="dead")
    dead = drain(write_key, w1.pk)
    assert (dead.status_code, dead.json()) == (
        409, {"detail": "agent w1 is dead: there is nothing to drain"},
    )  # fmt: skip
    assert Agent.objects.get(pk=w1.pk).drain_requested_at is None


def test_past_its_deadline_a_draining_agent_is_evicted_and_its_work_moves_on(tenant, write_key):
    routed_package(tenant)
    w1 = agent(tenant, "w1", max_concurrency=8)
    result, task = place_root(tenant)
    assert result.agent_name == "w1"
    agent(tenant, "w2")
    assert drain(write_key, w1.pk, {"timeout_s": 60}).status_code == 200
    assert sweep_dead_agents() == []  # within its deadline: left to finish
    Agent.objects.filter(pk=w1.pk).update(drain_deadline=timezone.now() - timedelta(seconds=1))
    (eviction,) = sweep_dead_agents()
    assert eviction.reason == "drain deadline passed with 1 task(s) still in flight"
    assert (eviction.in_flight, Eviction.objects.get().reassigned) == (1, 1)
    assert DeliveryOutbox.objects.get(task_execution=task).agent.name == "w2"
    assert Agent.objects.get(pk=w1.pk).state == "dead"


# -- the console button ------------------------------------------------------------------


@pytest.fixture
def console_user(tenant):
    def make(role: str):
        user = get_user_model().objects.create_user(f"{role}-user", f"{role}@example.com", "x")
        TenantMembership.objects.create(user=user, tenant=tenant, role=role)
        client = Client()
        client.force_login(user)
        return client

    return make


def test_the_console_button_drains_for_a_writer(tenant, console_user):
    w1 = agent(tenant, "w1")
    client = console_user("write")
    page = client.get(f"/console/tenants/{tenant.name}/partials/agents/")
    assert f'action="/console/tenants/acme/agents/{w1.pk}/drain/"' in page.content.decode()
    response = client.post(f"/console/tenants/acme/agents/{w1.pk}/drain/", HTTP_HX_REQUEST="true")
    assert response.status_code == 204
    assert "agent w1 draining, 0 task(s) in flight" in response["HX-Trigger"]
    assert Agent.objects.get(pk=w1.pk).state == "draining"
    page = client.get(f"/console/tenants/{tenant.name}/partials/agents/").content.decode()
    assert "drain/" not in page and "if still there" in page


def test_the_console_button_is_refused_to_a_reader(tenant, console_user):
    w1 = agent(tenant, "w1")
    client = console_user("read")
    page = client.get(f"/console/tenants/{tenant.name}/partials/agents/").content.decode()
    assert 'disabled title="your role in acme is read-only">Drain</button>' in page
    response = client.post(f"/console/tenants/acme/agents/{w1.pk}/drain/", HTTP_HX_REQUEST="true")
    assert response.status_code == 403
    assert response.json() == {"detail": "your role in tenant 'acme' is read-only"}
    assert Agent.objects.get(pk=w1.pk).state == "live"


def test_the_console_button_cannot_reach_another_tenants_agent(tenant, other_tenant, console_user):
    theirs = agent(other_tenant, "theirs")
    client = console_user("write")
    for name in ("acme", "globex"):
        response = client.post(
            f"/console/tenants/{name}/agents/{theirs.pk}/drain/", HTTP_HX_REQUEST="true"
        )
        assert response.status_code == 404
    assert client.get(f"/console/tenants/acme/agents/{theirs.pk}/drain/").status_code == 405
    assert Agent.objects.get(pk=theirs.pk).state == "live"
    assert ApiKey.objects.count() == 0
