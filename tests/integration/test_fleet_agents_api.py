"""The agents' REST API: register (and replace), heartbeat, results (fenced), deregister."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from agents.models import Agent
from fleet.executors.fleet.delivery.placement import place_task
from fleet.executors.fleet.lifecycle import revoke_key
from fleet.models import ApiKey, DeliveryOutbox, Eviction, TaskExecution, TaskOutcome, Tenant
from fleet.platform.config import reset_config
from tests.support.agents import make_agent
from tests.support.factories import ready_root, two_task_package
from tests.support.keys import bearer
from tests.support.outcomes import delivered_task, result_body

TRIPLE = "x86_64-unknown-linux-gnu"


def post(client: Client, path: str, key: str, body: dict | None = None):
    return client.post(
        f"/api/v1{path}",
        data=json.dumps(body or {}),
        content_type="application/json",
        **bearer(key),
    )


def register_body(**extra) -> dict:
    return {
        "name": "w1",
        "target_triple": TRIPLE,
        "max_concurrency": 2,
        "protocol_version": 1,
        "wire_format": "json",
        **extra,
    }


@pytest.fixture
def client() -> Client:
    return Client()


@pytest.mark.django_db
def test_it_registers_an_agent(client, agent_key, tenant):
    response = post(client, "/agents/register", agent_key, register_body(tags=["gpu"]))
    assert response.status_code == 201, response.content
    body = response.json()
    agent = Agent.objects.get(pk=body["agent_id"])
    assert (agent.tenant, agent.name, agent.max_concurrency, agent.tags) == (
        tenant,
        "w1",
        2,
        ["gpu"],
    )
    assert body["ws_path"] == f"/ws/agents/{agent.id}/"
    assert body["heartbeat_interval_s"] == 15.0 and body["liveness_misses"] == 3
    assert body["server_protocol_version"] == 1 and body["wire_format"] == "json"
    # What the socket takes besides the basic frames (docs/agent-protocol.md).
    assert (body["result_frames"], body["log_frames"], body["batch_frames"]) == (True, True, True)


@pytest.mark.django_db
def test_registering_a_live_name_again_replaces_it_and_reclaims_its_work(client, agent_key, tenant):
    two_task_package(tenant)
    old = Agent.objects.get(
        pk=post(client, "/agents/register", agent_key, register_body()).json()["agent_id"]
    )
    survivor = make_agent(tenant, "survivor")
    Agent.objects.filter(pk=old.pk).update(connected_to="elsewhere", max_concurrency=5, in_flight=0)
    _, task = ready_root(tenant)
    # Force the packet onto the old agent: the survivor is full for a moment.
    Agent.objects.filter(pk=survivor.pk).update(in_flight=2)
    place_task(task.pk, "s")
    assert DeliveryOutbox.objects.get(task_execution=task).agent_id == old.id
    Agent.objects.filter(pk=survivor.pk).update(in_flight=0)

    response = post(client, "/agents/register", agent_key, register_body())
    assert response.status_code == 201
    old.refresh_from_db()
    assert old.state == "dead"
    eviction = Eviction.objects.get(agent=old)
    assert "replaced" in eviction.reason and eviction.in_flight == 1 and eviction.reassigned == 1
    row = DeliveryOutbox.objects.get(task_execution=task)
    assert (row.agent_id, row.state, row.former_agents) == (survivor.id, "pending", [str(old.id)])


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("extra", "status", "fragment"),
    [
        ({"protocol_version": 2}, 409, "agent speaks protocol 2, this server supports 1"),
        ({"wire_format": "msgpack"}, 409, "wire format mismatch"),
        ({"target_triple": "nonsense"}, 422, "target_triple"),
        ({"max_concurrency": 0}, 422, "max_concurrency must be 1..1024"),
        ({"tags": [""]}, 422, "tags"),
    ],
)
def test_bad_registrations_are_refused_and_change_nothing(
    client, agent_key, extra, status, fragment, monkeypatch
):
    if "wire_format" in extra:
        # A server that insists on JSON (the default, auto, accepts both formats).
        monkeypatch.setenv("CLOACINA_WIRE_FORMAT", "json")
        reset_config()
    try:
        response = post(client, "/agents/register", agent_key, register_body(**extra))
    finally:
        monkeypatch.undo()
        reset_config()
    assert response.status_code == status
    assert fragment in response.json()["detail"]
    assert not Agent.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_a_server_set_to_auto_accepts_either_wire_format(client, agent_key, fmt):
    response = post(client, "/agents/register", agent_key, register_body(wire_format=fmt))
    assert response.status_code == 201, response.content
    assert response.json()["wire_format"] == fmt
    assert Agent.objects.get(pk=response.json()["agent_id"]).wire_format == fmt


@pytest.mark.django_db
def test_keys_other_than_agent_keys_are_refused(client, write_key, agent_key, tenant):
    assert post(client, "/agents/register", "clk_nope_nope", register_body()).status_code == 401
    response = post(client, "/agents/register", write_key, register_body())
    assert response.status_code == 403 and "needs agent" in response.json()["detail"]
    revoked, token = ApiKey.mint("agent", tenant=tenant)
    revoke_key(revoked)
    assert post(client, "/agents/register", token, register_body()).status_code == 401
    # …and an agent key may not use the other roles' endpoints.
    assert client.get("/api/v1/packages", **bearer(agent_key)).status_code == 403
    assert not Agent.objects.exists()


@pytest.mark.django_db
def test_heartbeats_keep_an_agent_alive_and_answer_drain(client, agent_key, tenant):
    agent = make_agent(tenant, heartbeat_age_s=5)
    before = agent.last_heartbeat
    response = post(
        client, f"/agents/{agent.id}/heartbeat", agent_key, {"in_flight": 0, "metrics": {"cpu": 3}}
    )
    assert response.json() == {"state": "live", "drain": False}
    agent.refresh_from_db()
    assert agent.last_heartbeat > before and agent.metrics == {"cpu": 3}
    Agent.objects.filter(pk=agent.pk).update(drain_requested_at="2030-01-01T00:00:00Z")
    assert post(client, f"/agents/{agent.id}/heartbeat", agent_key).json()["drain"] is True
    response = post(client, f"/agents/{agent.id}/heartbeat", agent_key, {"draining": True})
    assert response.json()["state"] == "draining"


@pytest.mark.django_db
def test_heartbeats_of_dead_unknown_or_foreign_agents_get_404(
    client, agent_key, tenant, other_tenant
):
    dead = make_agent(tenant, state="dead")
    foreign = make_agent(other_tenant)
    for agent_id in (dead.id, foreign.id, uuid.uuid4()):
        response = post(client, f"/agents/{agent_id}/heartbeat", agent_key)
        assert response.status_code == 404
        assert response.json() == {"detail": "unknown agent"}
    foreign.refresh_from_db()
    assert foreign.metrics == {}


@pytest.mark.django_db
def test_deregister_is_a_clean_exit(client, agent_key, tenant):
    agent = make_agent(tenant)
    assert post(client, f"/agents/{agent.id}/deregister", agent_key).status_code == 200
    agent.refresh_from_db()
    # A clean exit is stopped, not dead (issue 15): no eviction either.
    assert agent.state == "stopped" and agent.connected_to == ""
    assert not Eviction.objects.exists()
    assert post(client, f"/agents/{agent.id}/deregister", agent_key).status_code == 404


@pytest.mark.django_db(transaction=True)  # the result endpoint works on its own DB threads
def test_a_result_applies_once_and_a_retried_post_is_recorded_not_applied(
    client, agent_key, tenant
):
    two_task_package(tenant)
    agent = make_agent(tenant)
    task, row = delivered_task(tenant, agent)
    first = post(client, f"/agents/{agent.id}/results", agent_key, result_body(task, row))
    assert first.json() == {"applied": True, "reason": ""}
    again = post(
        client, f"/agents/{agent.id}/results", agent_key, result_body(task, row, output={"a": 2})
    )
    assert again.status_code == 200 and again.json()["applied"] is False
    task.refresh_from_db()
    assert (task.status, task.output_context) == ("Completed", {"a": 1})
    assert (
        TaskExecution.objects.get(workflow_execution=task.workflow_execution, task_name="b").status
        == "Ready"
    )
    row.refresh_from_db()
    assert row.state == "acked"
    agent.refresh_from_db()
    assert agent.in_flight == 0
    assert list(
        TaskOutcome.objects.filter(task_execution=task)
        .values_list("applied", flat=True)
        .order_by("id")
    ) == [True, False]


@pytest.mark.django_db(transaction=True)  # the result endpoint works on its own DB threads
def test_a_result_for_a_packet_of_another_agent_or_tenant_is_404(
    client, agent_key, tenant, other_tenant
):
    two_task_package(tenant)
    holder = make_agent(tenant, "holder")
    task, row = delivered_task(tenant, holder)
    Agent.objects.filter(pk=holder.pk).update(
        max_concurrency=1, in_flight=1
    )  # so `other` is not chosen
    other = make_agent(tenant, "other")
    response = post(client, f"/agents/{other.id}/results", agent_key, result_body(task, row))
    assert (
        response.status_code == 404 and "never addressed to this agent" in response.json()["detail"]
    )
    wrong_assignment = result_body(task, row, assignment=row.assignment + 1)
    assert (
        post(client, f"/agents/{holder.id}/results", agent_key, wrong_assignment).status_code == 404
    )
    foreign_key = ApiKey.mint("agent", tenant=other_tenant)[1]
    assert (
        post(
            client, f"/agents/{holder.id}/results", foreign_key, result_body(task, row)
        ).status_code
        == 404
    )
    task.refresh_from_db()
    assert task.status == "Running" and not TaskOutcome.objects.exists()


@pytest.mark.django_db(transaction=True)  # the result endpoint works on its own DB threads
def test_a_refusal_requeues_without_using_an_attempt(client, agent_key, tenant):
    two_task_package(tenant)
    agent = make_agent(tenant)
    task, row = delivered_task(tenant, agent)
    body = result_body(task, row, outcome="refused", output=None, error_message="wrong triple")
    assert post(client, f"/agents/{agent.id}/results", agent_key, body).json()["applied"] is True
    task.refresh_from_db()
    assert (task.status, task.attempt, task.refusals) == ("Ready", 0, 1)
    assert "wrong triple" in task.wait_reason


@pytest.mark.django_db(transaction=True)  # the result endpoint works on its own DB threads
def test_a_malformed_result_is_422_and_changes_nothing(client, agent_key, tenant):
    two_task_package(tenant)
    agent = make_agent(tenant)
    task, row = delivered_task(tenant, agent)
    response = post(
        client, f"/agents/{agent.id}/results", agent_key, result_body(task, row, outcome="great")
    )
    assert response.status_code == 422
    task.refresh_from_db()
    assert task.status == "Running" and not TaskOutcome.objects.exists()


@pytest.fixture
def setting(monkeypatch):
    """Set a configuration variable for this test (the configuration is re-read)."""

    def set_value(name: str, value: str) -> None:
        monkeypatch.setenv(name, value)
        reset_config()

    yield set_value
    monkeypatch.undo()
    reset_config()


@pytest.fixture
def registered_agents_cap(monkeypatch):
    """Restart with CLOACINA_MAX_REGISTERED_AGENTS set (the configuration is re-read)."""

    def set_cap(value: str) -> None:
        monkeypatch.setenv("CLOACINA_MAX_REGISTERED_AGENTS", value)
        reset_config()

    yield set_cap
    monkeypatch.undo()
    reset_config()


@pytest.mark.django_db
def test_the_registration_cap_follows_its_setting(client, agent_key, tenant, registered_agents_cap):
    Tenant.objects.filter(pk=tenant.pk).update(max_agents_override=1)
    registered_agents_cap("3")  # above the limit: room for 2 hand-run agents
    for n in range(3):
        assert (
            post(client, "/agents/register", agent_key, register_body(name=f"w{n}")).status_code
            == 201
        )
    refused = post(client, "/agents/register", agent_key, register_body(name="w3"))
    assert refused.status_code == 429
    assert "already has 3 agents" in refused.json()["detail"]
    assert "CLOACINA_MAX_REGISTERED_AGENTS=3" in refused.json()["detail"]
    # A restart under a held name passes; a dead agent frees its place.
    assert post(client, "/agents/register", agent_key, register_body(name="w0")).status_code == 201
    w1 = Agent.objects.get(name="w1")
    assert post(client, f"/agents/{w1.id}/deregister", agent_key).status_code == 200
    assert post(client, "/agents/register", agent_key, register_body(name="w3")).status_code == 201


@pytest.mark.django_db
def test_the_registration_cap_is_never_below_the_limit(
    client, agent_key, tenant, registered_agents_cap
):
    registered_agents_cap("1")  # the default limit (4) wins: the actuators' agents always fit
    for n in range(4):
        assert (
            post(client, "/agents/register", agent_key, register_body(name=f"w{n}")).status_code
            == 201
        )
    assert post(client, "/agents/register", agent_key, register_body(name="w4")).status_code == 429
    registered_agents_cap("auto")  # max(64, 4 × 4)
    assert post(client, "/agents/register", agent_key, register_body(name="w4")).status_code == 201


@pytest.mark.django_db
def test_a_registration_past_the_rate_says_when_the_window_frees(
    client, agent_key, tenant, setting
):
    setting("CLOACINA_AGENT_REGISTRATIONS_PER_KEY_PER_MINUTE", "2")
    for name in ("w0", "w1"):
        assert (
            post(client, "/agents/register", agent_key, register_body(name=name)).status_code == 201
        )
    # The older of the two ages out of the minute in ~10 s: that is when to come back.
    Agent.objects.filter(name="w0").update(registered_at=timezone.now() - timedelta(seconds=50))
    refused = post(client, "/agents/register", agent_key, register_body(name="w2"))
    assert refused.status_code == 429
    assert 9 <= int(refused["Retry-After"]) <= 11


@pytest.mark.django_db
def test_a_registration_past_the_cap_gets_a_fixed_retry_after(
    client, agent_key, tenant, registered_agents_cap
):
    Tenant.objects.filter(pk=tenant.pk).update(max_agents_override=1)
    registered_agents_cap("1")
    assert post(client, "/agents/register", agent_key, register_body(name="w0")).status_code == 201
    refused = post(client, "/agents/register", agent_key, register_body(name="w1"))
    assert refused.status_code == 429
    assert refused["Retry-After"] == "30"
