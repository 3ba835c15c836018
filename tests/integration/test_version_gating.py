"""Version gating: the server refuses, at registration, an agent whose protocol version it
does not speak, naming both versions; the agent stops with that message and exit code 2.

Here: the integration tests (database, in-process ASGI, fakes); the rest are in tests/e2e/test_version_gating.py.
"""

from __future__ import annotations

import pytest

from agents.models import Agent
from agents.protocol.triples import host_triple
from fleet.api.error_status import http_status
from fleet.executors.fleet import roster
from fleet.models import ApiKey
from tests.support.keys import bearer

REFUSAL = "agent speaks protocol 2, this server supports 1"


def registration(protocol_version: int, version: str = "cloacina-agent/9.0") -> roster.Registration:
    return roster.Registration(
        name="w1", target_triple=host_triple(), protocol_version=protocol_version, version=version
    )


@pytest.mark.django_db
def test_the_roster_refuses_an_unsupported_protocol_naming_both_versions(tenant):
    key = ApiKey.mint("agent", tenant=tenant)[0]
    with pytest.raises(roster.RosterError) as info:
        roster.register(key, registration(2))
    assert http_status(info.value) == 409
    assert REFUSAL in info.value.detail and "cloacina-agent/9.0" in info.value.detail
    assert not Agent.objects.exists()
    assert roster.register(key, registration(1)).protocol_version == 1


@pytest.mark.django_db
def test_a_server_that_speaks_two_versions_takes_both_and_names_both(tenant, monkeypatch):
    # A rolling upgrade: the new server still speaks the old protocol.
    monkeypatch.setattr(roster, "SUPPORTED_PROTOCOL_VERSIONS", (1, 2))
    key = ApiKey.mint("agent", tenant=tenant)[0]
    assert roster.register(key, registration(2)).protocol_version == 2
    with pytest.raises(roster.RosterError) as info:
        roster.register(key, registration(3))
    assert "agent speaks protocol 3, this server supports 1 and 2" in info.value.detail


@pytest.mark.django_db
def test_the_rest_refusal_is_a_409_with_the_message_and_changes_nothing(client, agent_key):
    body = {"target_triple": host_triple(), "protocol_version": 2, "version": "x/2"}
    response = client.post(
        "/api/v1/agents/register", body, content_type="application/json", **bearer(agent_key)
    )
    assert response.status_code == 409
    assert REFUSAL in response.json()["detail"]
    assert not Agent.objects.exists()
