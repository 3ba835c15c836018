"""Secrets: API keys are stored hashed (a database dump holds no usable key), compared in
constant time, revocable (everywhere at once, an open delivery socket included) and
carry a last-used timestamp; the keys actuators mint for their agents are never logged.

Here: the integration tests (database, in-process ASGI, fakes); the rest are in tests/e2e/test_secrets.py.
"""

from __future__ import annotations

import hmac
import logging
from pathlib import Path

import pytest
from django.test import Client

from fleet.models import ApiKey
from tests.support.keys import bearer


def _secret_part(token: str) -> str:
    return token.split("_", 2)[2]


@pytest.mark.django_db
def test_keys_are_compared_in_constant_time(tenant, monkeypatch):
    """The stored hash is only ever compared with hmac.compare_digest (no early exit on the
    first differing character); a wrong secret under a real lookup takes the same path."""
    from fleet.platform import tenancy

    key, token = ApiKey.mint("read", tenant=tenant)
    calls = []
    compare = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(tenancy.hmac, "compare_digest", spy)
    assert ApiKey.verify(token) == key
    wrong = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    assert ApiKey.verify(wrong) is None
    assert calls == [
        (key.key_hash, tenancy.hash_secret(token)),
        (key.key_hash, tenancy.hash_secret(wrong)),
    ]
    # Nothing compares the key row's hash any other way.
    source = Path(tenancy.__file__).read_text()
    assert "key_hash ==" not in source and "== hash_secret" not in source


@pytest.mark.django_db
def test_each_key_records_when_it_was_last_used(tenant, monkeypatch):
    from fleet.platform import auth

    key, token = ApiKey.mint("read", tenant=tenant)
    assert key.last_used_at is None
    assert Client().get("/api/v1/fleet", **bearer(token)).status_code == 200
    key.refresh_from_db()
    first = key.last_used_at
    assert first is not None
    # Within the granularity it is not written again (no write per request)…
    assert Client().get("/api/v1/fleet", **bearer(token)).status_code == 200
    key.refresh_from_db()
    assert key.last_used_at == first
    # …past it, it is.
    monkeypatch.setattr(auth, "LAST_USED_GRANULARITY_S", -1)
    assert Client().get("/api/v1/fleet", **bearer(token)).status_code == 200
    key.refresh_from_db()
    assert key.last_used_at > first
    # A refused request (wrong role) does not count as a use.
    ApiKey.objects.filter(pk=key.pk).update(last_used_at=None)
    assert Client().post("/api/v1/fleet/provision", **bearer(token)).status_code == 403
    key.refresh_from_db()
    assert key.last_used_at is None


def _assert_not_in(token: str, texts: dict[str, str]) -> None:
    for where, text in texts.items():
        assert token not in text, f"an agent key appears in {where}"
        assert _secret_part(token) not in text, f"an agent key's secret appears in {where}"


def test_the_docker_and_kubernetes_actuators_keys_are_never_logged(db, tenant, caplog, capfd):
    """Both against their fake APIs (the SDKs' real HTTP calls), every logger at DEBUG."""
    import base64

    import docker
    import kubernetes.client as k8s

    from fleet.control.actuators.docker import DockerActuator
    from fleet.control.actuators.kubernetes import KubernetesActuator
    from fleet.control.actuators.settings import ControlSettings
    from tests.support.fakes.docker_engine import FakeDockerEngine
    from tests.support.fakes.kubernetes_api import SETTINGS, FakeKubernetesApi

    caplog.set_level(logging.DEBUG)
    tokens = []
    with FakeDockerEngine() as engine:
        settings = ControlSettings(
            server_url="http://cloacina.internal:8000", agent_image="cloacina:test",
            agent_max_concurrency=3, agent_drain_timeout_s=30,
        )  # fmt: skip
        actuator = DockerActuator(
            settings, client_factory=lambda: docker.DockerClient(base_url=engine.base_url)
        )
        actuator.reconcile(tenant, 2)
        for box in engine.containers.values():
            env = dict(item.split("=", 1) for item in box.config["Env"])
            tokens.append(env["CLOACINA_AGENT_API_KEY"])
        actuator.reconcile(tenant, 0)
    with FakeKubernetesApi() as api:
        actuator = KubernetesActuator(SETTINGS, k8s.ApiClient(k8s.Configuration(host=api.host)))
        actuator.reconcile(tenant, 2)
        secrets = [obj for (kind, _ns, _name), obj in api.objects.items() if kind == "secrets"]
        for secret in secrets:
            tokens.append(base64.b64decode(secret["data"]["api-key"]).decode())
    assert len(tokens) == 3 and all(ApiKey.verify(t) for t in tokens)
    out, err = capfd.readouterr()
    assert caplog.records, "nothing was logged: the check would prove nothing"
    texts = {"log records": caplog.text, "stdout": out, "stderr": err}
    for token in tokens:
        _assert_not_in(token, texts)


@pytest.mark.django_db
def test_the_keys_of_a_deactivated_tenant_stop_working(tenant):
    from fleet.control import limits

    keys = {role: ApiKey.mint(role, tenant=tenant)[1] for role in ("read", "write", "agent")}
    client = Client()
    assert client.get("/api/v1/executions", **bearer(keys["read"])).status_code == 200
    # Through the limits' owner, as the admin and the console do: this process's key cache
    # forgets the tenant at once (another process's within its TTL: test_rest_path.py).
    limits.set_tenant_limits(tenant, "admin:root", "offboarding", is_active=False)
    for role, key in keys.items():
        answer = client.get("/api/v1/executions", **bearer(key))
        assert answer.status_code == 401, (role, answer.content)
        assert "invalid or revoked" in answer.json()["detail"]
        assert ApiKey.verify(key) is None
    answer = client.post(
        "/api/v1/agents/register",
        {"name": "a", "target_triple": "x86_64-unknown-linux-gnu", "protocol_version": 1},
        content_type="application/json",
        **bearer(keys["agent"]),
    )
    assert answer.status_code == 401
