"""The fleet REST API: roles, bounds and the admin override, through HTTP."""

from __future__ import annotations

import json

import pytest

from fleet.models import FleetChange, Tenant
from tests.support.keys import bearer


def put_fleet(client, name, body, key):
    return client.put(
        f"/api/v1/admin/tenants/{name}/fleet",
        data=json.dumps(body),
        content_type="application/json",
        **bearer(key),
    )


def test_it_shows_the_tenants_fleet(client, tenant, read_key):
    from agents.models import Agent

    Agent.objects.create(tenant=tenant, name="a1", target_triple="x86_64-unknown-linux-gnu",
                         max_concurrency=2, in_flight=1)  # fmt: skip
    res = client.get("/api/v1/fleet", **bearer(read_key))
    assert res.status_code == 200
    body = res.json()
    assert body["desired_count"] == 0
    assert body["effective_limit"] == 4
    assert body["utilization"] == 0.5
    assert body["outbox_open"] == 0
    assert body["backlog"] == 0
    [agent] = body["agents"]
    assert agent["name"] == "a1" and agent["state"] == "live"
    assert agent["max_concurrency"] == 2 and agent["in_flight"] == 1
    assert agent["target_triple"] == "x86_64-unknown-linux-gnu" and agent["last_heartbeat"]


def test_it_never_shows_another_tenants_agents(client, tenant, other_tenant, read_key):
    from agents.models import Agent

    Agent.objects.create(tenant=other_tenant, name="theirs", target_triple="t")
    assert client.get("/api/v1/fleet", **bearer(read_key)).json()["agents"] == []


def test_it_requires_a_key(client, tenant):
    res = client.get("/api/v1/fleet")
    assert res.status_code == 401
    assert "Authorization" in res.json()["detail"]
    res = client.post("/api/v1/fleet/provision", **bearer("clk_nope_nope"))
    assert res.status_code == 401


def test_a_write_key_provisions_within_the_limit(client, tenant, write_key):
    for n in (1, 2, 3, 4):
        res = client.post("/api/v1/fleet/provision", **bearer(write_key))
        assert res.status_code == 200, res.content
        assert res.json()["desired_count"] == n
    res = client.post("/api/v1/fleet/provision", **bearer(write_key))
    assert res.status_code == 409
    assert "effective limit (4)" in res.json()["detail"]
    tenant.refresh_from_db()
    assert tenant.desired_count == 4
    actors = set(FleetChange.objects.filter(tenant=tenant).values_list("actor", flat=True))
    assert actors == {f"write key {write_key.split('_')[1]}"}


def test_deprovision_stops_at_zero_with_409(client, tenant, write_key):
    res = client.post("/api/v1/fleet/deprovision", **bearer(write_key))
    assert res.status_code == 409
    assert "already 0" in res.json()["detail"]


@pytest.mark.parametrize("role_fixture", ["read_key", "agent_key", "admin_key"])
def test_only_write_keys_provision(client, tenant, role_fixture, request):
    key = request.getfixturevalue(role_fixture)
    res = client.post("/api/v1/fleet/provision", **bearer(key))
    assert res.status_code == 403
    tenant.refresh_from_db()
    assert tenant.desired_count == 0


def test_provision_only_touches_the_keys_own_tenant(client, tenant, other_tenant, other_write_key):
    client.post("/api/v1/fleet/provision", **bearer(other_write_key))
    tenant.refresh_from_db()
    other_tenant.refresh_from_db()
    assert (tenant.desired_count, other_tenant.desired_count) == (0, 1)


def test_a_tenant_can_never_raise_its_own_ceiling(client, tenant, write_key):
    res = put_fleet(client, tenant.name, {"max_agents_override": 50}, write_key)
    assert res.status_code == 403
    tenant.refresh_from_db()
    assert tenant.max_agents_override is None


def test_an_admin_sets_the_override_and_clamps(client, tenant, write_key, admin_key):
    for _ in range(3):
        client.post("/api/v1/fleet/provision", **bearer(write_key))
    res = put_fleet(client, tenant.name, {"max_agents_override": 1}, admin_key)
    assert res.status_code == 200, res.content
    assert res.json() == {
        "tenant": "acme",
        "desired_count": 1,
        "effective_limit": 1,
        "max_agents_override": 1,
        "overridden": True,
    }
    assert FleetChange.objects.filter(tenant=tenant, reason="clamp").count() == 1
    # and the tenant now sees its new ceiling
    res = client.post("/api/v1/fleet/provision", **bearer(write_key))
    assert res.status_code == 409 and "(1)" in res.json()["detail"]


def test_an_admin_clears_the_override_with_null(client, tenant, admin_key):
    Tenant.objects.filter(pk=tenant.pk).update(max_agents_override=9)
    res = put_fleet(client, tenant.name, {"max_agents_override": None}, admin_key)
    assert res.status_code == 200
    assert res.json()["overridden"] is False and res.json()["effective_limit"] == 4


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({}, 422, "max_agents_override and/or desired_count"),
        ({"desired_count": 9}, 422, "exceeds the effective limit (4)"),
        ({"desired_count": -1}, 422, "non-negative"),
        ({"desired_count": None}, 422, "non-negative"),
        ({"max_agents_override": -3}, 422, "non-negative"),
        ({"max_agents": 3}, 422, "max_agents"),
        ({"max_agents_override": "lots"}, 422, "max_agents_override"),
    ],
)
def test_bad_admin_input_is_a_clear_error_and_changes_nothing(
    client, tenant, admin_key, body, status, words
):
    res = put_fleet(client, tenant.name, body, admin_key)
    assert res.status_code == status
    assert words in json.dumps(res.json()["detail"])
    tenant.refresh_from_db()
    assert (tenant.max_agents_override, tenant.desired_count) == (None, 0)
    assert not FleetChange.objects.exists()


def test_an_unknown_tenant_is_404(client, admin_key):
    res = put_fleet(client, "nobody", {"desired_count": 1}, admin_key)
    assert res.status_code == 404
    assert res.json() == {"detail": "unknown tenant 'nobody'"}


def test_history_lists_changes_and_decisions(client, tenant, write_key, read_key):
    client.post("/api/v1/fleet/provision", **bearer(write_key))
    res = client.get("/api/v1/fleet/history", **bearer(read_key))
    assert res.status_code == 200
    [change] = res.json()["changes"]
    assert (change["field"], change["old_value"], change["new_value"], change["reason"]) == (
        "desired_count",
        0,
        1,
        "manual",
    )
    assert client.get("/api/v1/fleet/history?limit=0", **bearer(read_key)).status_code == 422
