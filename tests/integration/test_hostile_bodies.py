"""Bodies that used to be 500s, through the real URL conf and the test database: NaN and
Infinity in an agent's metrics, raw lone-surrogate bytes (invalid UTF-8) and escaped lone
surrogates in a JSON body, NUL in a manifest's routing strings.  Each is a 4xx
``{"detail": …}`` naming the problem, and nothing is stored.
"""

from __future__ import annotations

import json

import pytest
from django.test import Client

from agents.models import Agent
from agents.protocol.triples import host_triple
from artifacts.store.manifest import ManifestError, parse_manifest
from artifacts.store.testing import build_archive, manifest_toml, package_files
from fleet.api.error_status import http_status
from fleet.executors.fleet import roster
from tests.support.keys import bearer

pytestmark = pytest.mark.django_db

REGISTER = {"name": "a1", "target_triple": host_triple(), "protocol_version": 1}
LONE = b"\xed\xa0\x80"  # a lone surrogate (U+D800) as raw bytes: not UTF-8


def _post(key: str, path: str, body: bytes):
    return Client().post(f"/api/v1{path}", body, content_type="application/json", **bearer(key))


@pytest.fixture
def agent(tenant, agent_key):
    answer = _post(agent_key, "/agents/register", json.dumps(REGISTER).encode())
    assert answer.status_code == 201, answer.content
    return Agent.objects.get(pk=answer.json()["agent_id"])


# (what, body, status, words of the detail)
REGISTRATIONS = [
    ("NaN metric", json.dumps({**REGISTER, "metrics": {"load": float("nan")}}), 422, "NaN"),
    ("Infinity metric", json.dumps({**REGISTER, "metrics": {"x": float("inf")}}), 422, "Infinity"),
    ("-Infinity metric", json.dumps({**REGISTER, "metrics": {"x": -float("inf")}}), 422, "Infinity"),
    ("raw surrogate name", b'{"name": "' + LONE + b'", "protocol_version": 1}', 400, "UTF-8"),
    ("raw surrogate metric", b'{"metrics": {"a": "' + LONE + b'"}}', 400, "UTF-8"),
    ("raw surrogate key", b'{"metrics": {"' + LONE + b'": 1}}', 400, "UTF-8"),
    ("escaped surrogate name", '{"name": "\\ud800", "protocol_version": 1}', 422, "lone surrogate"),
    ("escaped surrogate tag", '{"tags": ["\\udfff"], "protocol_version": 1}', 422, "lone surrogate"),
    ("escaped NUL metric", '{"metrics": {"a": "\\u0000"}}', 422, "NUL"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "body", "status", "words"), REGISTRATIONS)
def test_a_hostile_registration_is_a_4xx_and_registers_nothing(
    tenant, agent_key, what, body, status, words
):
    data = body if isinstance(body, bytes) else body.encode()
    if data.startswith(b'{"') and b"target_triple" not in data:  # a full body otherwise
        data = data[:-1] + b', "target_triple": "' + host_triple().encode() + b'"}'
    answer = _post(agent_key, "/agents/register", data)
    assert answer.status_code == status, (what, answer.content)
    assert words in answer.json()["detail"], (what, answer.json())
    assert Agent.objects.count() == 0


BEATS = [
    ("NaN", b'{"metrics": {"load": NaN}}', 422, "NaN"),
    ("Infinity", b'{"metrics": {"load": Infinity}}', 422, "Infinity"),
    ("-Infinity", b'{"in_flight": 0, "metrics": {"load": -Infinity}}', 422, "Infinity"),
    ("raw surrogate", b'{"metrics": {"gpu": "' + LONE + b'"}}', 400, "UTF-8"),
    ("escaped surrogate", b'{"metrics": {"gpu": "\\udc00"}}', 422, "lone surrogate"),
]


@pytest.mark.parametrize(("what", "body", "status", "words"), BEATS)
def test_a_hostile_heartbeat_is_a_4xx_and_changes_nothing(
    agent, agent_key, what, body, status, words
):
    before = Agent.objects.values("metrics", "last_heartbeat").get(pk=agent.pk)
    answer = _post(agent_key, f"/agents/{agent.pk}/heartbeat", body)
    assert answer.status_code == status, (what, answer.content)
    assert words in answer.json()["detail"], (what, answer.json())
    assert Agent.objects.values("metrics", "last_heartbeat").get(pk=agent.pk) == before


def test_a_raw_surrogate_in_an_execution_context_is_a_400(tenant, write_key):
    from fleet.models import WorkflowExecution
    from tests.support.factories import publish_example

    publish_example(tenant)
    answer = _post(write_key, "/workflows/etl/executions", b'{"context": {"a": "' + LONE + b'"}}')
    assert answer.status_code == 400, answer.content
    assert "invalid UTF-8" in answer.json()["detail"]
    assert WorkflowExecution.objects.count() == 0


@pytest.mark.parametrize("metrics", [{"a": float("nan")}, {"a": [float("-inf")]}, {"a": "\ud800"}])
def test_the_roster_refuses_metrics_jsonb_cannot_store(metrics):
    with pytest.raises(roster.RosterError) as refused:
        roster.check_metrics(metrics)
    assert http_status(refused.value) == 422


# -- NUL in a manifest's routing strings ---------------------------------------------------

NUL = "gpu\x00x"
ROUTING_WITH_NUL = {
    "tags": ["fast", NUL],
    "agent": NUL,
    "capability": NUL,
    "group": NUL,
    "gpu": NUL,
    "affinity": f"payload:{NUL}",
}


@pytest.mark.parametrize("key", list(ROUTING_WITH_NUL))
def test_a_nul_in_a_routing_string_names_the_field(key):
    text = manifest_toml([{"id": "a", "function": "demo.steps:a", key: ROUTING_WITH_NUL[key]}])
    assert "\\u0000" in text  # written as a TOML escape, as an author would
    with pytest.raises(ManifestError) as refused:
        parse_manifest(text)
    assert f"{key} holds a NUL character" in str(refused.value)


@pytest.mark.parametrize("key", list(ROUTING_WITH_NUL))
def test_a_package_with_a_nul_in_its_manifest_is_refused_and_stores_nothing(tenant, write_key, key):
    from artifacts.models import WorkflowPackage

    tasks = [{"id": "a", "function": "demo.steps:a", key: ROUTING_WITH_NUL[key]}]
    archive = build_archive(package_files(tasks))
    answer = Client().post("/api/v1/packages", {"file": _upload(archive)}, **bearer(write_key))
    assert 400 <= answer.status_code < 500, answer.content
    assert f"{key} holds a NUL character" in answer.json()["detail"]
    assert WorkflowPackage.objects.count() == 0


def _upload(data: bytes):
    from django.core.files.uploadedfile import SimpleUploadedFile

    return SimpleUploadedFile("pkg.tar.gz", data, content_type="application/gzip")
