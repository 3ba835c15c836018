"""Registration storms: the per-process admission of agents (registrations and socket
opens per second), the per-tenant registration rate, and the "go elsewhere" refusal of a
stopping server — each a clear refusal with when to come back, nothing stored, nobody
already connected disturbed."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from agents.models import Agent
from fleet.executors.fleet.delivery import local_sockets
from fleet.models import ApiKey, Eviction
from tests.support.agents import make_agent
from tests.support.keys import bearer
from tests.support.loop import run_async
from tests.support.sockets import opened, socket

TRIPLE = "x86_64-unknown-linux-gnu"


@pytest.fixture(autouse=True)
def _fresh_sockets():
    local_sockets.clear()
    yield
    local_sockets.clear()


def register(client: Client, key: str, name: str):
    body = {"name": name, "target_triple": TRIPLE, "max_concurrency": 1, "protocol_version": 1}
    return client.post(
        "/api/v1/agents/register", data=json.dumps(body), content_type="application/json",
        **bearer(key),
    )  # fmt: skip


@pytest.mark.django_db
def test_registrations_past_the_admission_rate_get_429_with_their_own_turn(
    tenant, agent_key, setting
):
    setting(CLOACINA_AGENT_ADMISSIONS_PER_S="0.1")  # one now, then one every 10 s
    back = make_agent(tenant, name="already-back")
    client = Client()
    answers = [register(client, agent_key, f"w{n}") for n in range(5)]
    assert [a.status_code for a in answers] == [201, 429, 429, 429, 429]
    turns = [int(a["Retry-After"]) for a in answers[1:]]
    # Each refused caller has a turn of its own, one admission interval after the last.
    assert all(8 <= later - earlier <= 12 for earlier, later in zip(turns, turns[1:], strict=False))
    assert "CLOACINA_AGENT_ADMISSIONS_PER_S" in answers[1].json()["detail"]
    assert set(Agent.objects.values_list("name", flat=True)) == {"already-back", "w0"}
    back.refresh_from_db()
    assert back.state == "live" and not Eviction.objects.exists()


@pytest.mark.django_db
def test_the_per_tenant_rate_counts_every_key_of_the_tenant(tenant, setting):
    setting(
        CLOACINA_AGENT_REGISTRATIONS_PER_TENANT_PER_MINUTE="2",
        CLOACINA_AGENT_ADMISSIONS_PER_S="0",
    )
    keys = [ApiKey.mint("agent", tenant=tenant)[1] for _ in range(3)]
    client = Client()
    codes = [register(client, key, f"w{n}").status_code for n, key in enumerate(keys)]
    assert codes == [201, 201, 429]
    refused = register(client, keys[2], "w2")
    assert "registered 2 agents in the last minute (at most 2" in refused.json()["detail"]
    assert 55 <= int(refused["Retry-After"]) <= 60  # when the older one leaves the minute
    assert Agent.objects.count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_socket_past_the_admission_rate_is_closed_4013_saying_when_to_retry(
    tenant, agent_key, setting
):
    setting(CLOACINA_AGENT_ADMISSIONS_PER_S="0.1")  # one now, the next in 10 s
    agents = [make_agent(tenant, name=f"a{n}", connected=False) for n in range(2)]

    async def scenario() -> list[dict]:
        ends = []
        for agent in agents:
            comm = socket(agent.id, agent_key)
            await opened(comm)
            ends.append(await comm.receive_output(1.0) if agent is agents[-1] else {})
            await comm.disconnect()
        return ends

    ends = run_async(scenario())
    assert ends[-1]["type"] == "websocket.close" and ends[-1]["code"] == 4013
    assert ends[-1]["reason"].startswith("server busy: retry after ")
    assert 9 <= int(ends[-1]["reason"].split()[-2]) <= 11
    # The first socket took its agent (a connection generation); the refused one never did.
    generations = Agent.objects.order_by("name").values_list("connection_generation", flat=True)
    assert list(generations) == [1, 0]


@pytest.mark.django_db(transaction=True)
def test_a_stopping_server_sends_new_sockets_elsewhere_with_4012(tenant, agent_key):
    agent = make_agent(tenant, connected=False)
    local_sockets.stop_accepting()

    async def scenario() -> dict:
        comm = socket(agent.id, agent_key)
        await comm.connect()
        end = await comm.receive_output(1.0)
        await comm.disconnect()
        return end

    end = run_async(scenario())
    assert (end["type"], end["code"]) == ("websocket.close", 4012)
    assert "connect to another server" in end["reason"]
    agent.refresh_from_db()
    assert agent.connected_to == ""  # refused before the socket took the agent
