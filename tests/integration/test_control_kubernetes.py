"""The kubernetes actuator: rendered objects validated against the client's schema models,
and the actuator driven against a fake API server at the HTTP boundary.

Here: the integration tests (database, in-process ASGI, fakes); the rest are in tests/unit/test_control_kubernetes.py.
"""

from __future__ import annotations

import base64
import logging
import shutil
import ssl
import subprocess
from dataclasses import replace

import pytest
from kubernetes import client as k8s

from agents.models import Agent
from fleet.control.actuators import kubernetes_manifests as m
from fleet.control.actuators.kubernetes import KubernetesActuator
from fleet.control.actuators.naming import tenant_label, tenant_namespace
from fleet.control.actuators.settings import ControlSettings
from fleet.control.jobs import build_actuator
from fleet.control.reconciler import reconcile_all
from fleet.control.substrate import SubstrateProbe
from fleet.models import ApiKey, Role, Tenant
from fleet.platform.config import load_config
from tests.support.fakes.kubernetes_api import SETTINGS, FakeKubernetesApi


# -- the actuator against the fake API server -----------------------------------------
@pytest.fixture
def api():
    with FakeKubernetesApi() as fake:
        yield fake


def make_actuator(api, settings=SETTINGS):
    configuration = k8s.Configuration(host=api.host)
    return KubernetesActuator(settings, k8s.ApiClient(configuration))


@pytest.fixture
def actuator(api):
    return make_actuator(api)


def secret_lookup_and_token(api, ns):
    secret = api.get("secrets", ns, "cloacina-agent-key")
    token = base64.b64decode(secret["data"]["api-key"]).decode()
    return secret["metadata"]["annotations"]["cloacina.io/key-lookup"], token


def test_it_creates_the_namespace_secret_policy_and_deployment(api, actuator, tenant):
    result = actuator.reconcile(tenant, 2)
    assert result.started == 2
    label, ns = tenant_label("acme"), tenant_namespace("acme")
    namespace = api.namespaces[ns]
    assert namespace["metadata"]["labels"] == {
        "cloacina.managed": "true",
        "cloacina.tenant": label,
        "pod-security.kubernetes.io/enforce": "restricted",
        "kubernetes.io/metadata.name": ns,
    }
    lookup, token = secret_lookup_and_token(api, ns)
    key = ApiKey.verify(token)
    assert key.lookup == lookup and key.role == Role.AGENT and key.tenant_id == tenant.pk
    dep = api.get("deployments", ns, "cloacina-agent")
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"] == m.render_deployment(ns, label, 2, SETTINGS)["spec"]
    assert dep["metadata"]["labels"]["cloacina.tenant"] == label
    policy = api.get("networkpolicies", ns, "cloacina-agent")
    assert policy["spec"] == {
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "cloacina-agent"}},
        "policyTypes": ["Ingress", "Egress"],
        "ingress": [],
        "egress": [
            {
                "to": [
                    {
                        "namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": "kube-system"}
                        },
                        "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
                    }
                ],
                "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
            },
            {
                "to": [
                    {
                        "namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": "cloacina"}
                        },
                        "podSelector": {
                            "matchLabels": {
                                "app.kubernetes.io/name": "cloacina",
                                "app.kubernetes.io/component": "server",
                            }
                        },
                    }
                ],
                "ports": [{"protocol": "TCP", "port": 8000}],
            },
        ],
    }
    assert len(actuator.actual(tenant)) == 2
    writes = [c for c in api.requests if c.method in ("POST", "PUT")]
    assert writes and {c.q("fieldValidation") for c in writes} == {"Strict"}


def test_everything_it_touches_is_in_the_tenants_namespace(api, actuator, tenant, other_tenant):
    actuator.reconcile(other_tenant, 1)
    first = len(api.requests)
    actuator.reconcile(tenant, 2)
    actuator.reconcile(tenant, 3)
    actuator.reconcile(tenant, 1)
    actuator.actual(tenant)
    actuator.stop_all(tenant)
    ns = tenant_namespace("acme")
    for call in api.requests[first:]:
        if call.path in ("/api/v1/namespaces",):
            continue
        assert f"/namespaces/{ns}" in call.path, call.path
    assert (
        api.get("deployments", tenant_namespace("globex"), "cloacina-agent")["spec"]["replicas"]
        == 1
    )


def test_scaling_drives_replicas(api, actuator, tenant):
    ns = tenant_namespace("acme")
    actuator.reconcile(tenant, 1)
    api.set_ready(ns)
    assert actuator.reconcile(tenant, 3).started == 2
    assert api.get("deployments", ns, "cloacina-agent")["spec"]["replicas"] == 3
    assert actuator.reconcile(tenant, 0).stopped == 3
    assert api.get("deployments", ns, "cloacina-agent")["spec"]["replicas"] == 0
    scales = [c.body for c in api.calls("PATCH", "/scale")]
    assert scales == [{"spec": {"replicas": 3}}, {"spec": {"replicas": 0}}]


def test_it_never_re_mints_while_pods_are_not_ready(api, actuator, tenant):
    ns = tenant_namespace("acme")
    actuator.reconcile(tenant, 1)
    first_lookup, _ = secret_lookup_and_token(api, ns)
    writes_before = len(api.calls("PUT", "/secrets/")) + len(api.calls("POST", "/secrets"))
    # A slow cluster: pods never become ready while the count keeps climbing and ticks repeat.
    for desired in (2, 3, 3, 3, 4, 4):
        actuator.reconcile(tenant, desired)
    assert ApiKey.objects.filter(tenant=tenant).count() == 1
    assert secret_lookup_and_token(api, ns)[0] == first_lookup
    writes = len(api.calls("PUT", "/secrets/")) + len(api.calls("POST", "/secrets"))
    assert writes == writes_before
    # Once the rollout is complete, the next scale-up rotates the shared key.
    api.set_ready(ns)
    actuator.reconcile(tenant, 5)
    new_lookup, token = secret_lookup_and_token(api, ns)
    assert new_lookup != first_lookup and ApiKey.verify(token).lookup == new_lookup
    assert ApiKey.objects.filter(tenant=tenant).count() == 2


def test_a_superseded_key_is_revoked_once_no_agent_uses_it(api, actuator, tenant):
    ns = tenant_namespace("acme")
    actuator.reconcile(tenant, 1)
    old_lookup, _ = secret_lookup_and_token(api, ns)
    old_key = ApiKey.objects.get(lookup=old_lookup)
    agent = Agent.objects.create(tenant=tenant, api_key=old_key, name="cloacina-agent-0",
                                 target_triple="x86_64-unknown-linux-gnu")  # fmt: skip
    api.set_ready(ns)
    actuator.reconcile(tenant, 2)  # rotates
    api.set_ready(ns)
    actuator.reconcile(tenant, 2)
    old_key.refresh_from_db()
    assert old_key.revoked_at is None  # a running pod still uses it
    Agent.objects.filter(pk=agent.pk).update(state="dead")
    actuator.reconcile(tenant, 2)
    old_key.refresh_from_db()
    assert old_key.revoked_at is not None
    current = ApiKey.objects.get(lookup=secret_lookup_and_token(api, ns)[0])
    assert current.revoked_at is None


def test_no_policy_without_the_servers_coordinates(api, tenant, caplog):
    settings = ControlSettings(server_url="http://cloacina:8000")
    actuator = make_actuator(api, settings)
    with caplog.at_level(logging.WARNING):
        actuator.reconcile(tenant, 1)
        actuator.reconcile(tenant, 1)
    ns = tenant_namespace("acme")
    assert api.get("networkpolicies", ns, "cloacina-agent") is None
    assert api.get("deployments", ns, "cloacina-agent") is not None  # the fleet still runs
    warnings = [r for r in caplog.records if "NOT installing the NetworkPolicy" in r.message]
    assert len(warnings) == 1  # said once, not every tick


def test_the_policy_toggle_turns_it_off(api, tenant):
    actuator = make_actuator(api, replace(SETTINGS, network_policy=False))
    actuator.reconcile(tenant, 1)
    assert api.get("networkpolicies", tenant_namespace("acme"), "cloacina-agent") is None


def test_dns_egress_goes_to_the_configured_cluster_dns_only(api, tenant):
    settings = replace(
        SETTINGS,
        cluster_dns_namespace="dns-system",
        cluster_dns_pod_labels="app=coredns, tier=node",
    )
    make_actuator(api, settings).reconcile(tenant, 1)
    egress = api.get("networkpolicies", tenant_namespace("acme"), "cloacina-agent")["spec"][
        "egress"
    ]
    dns = [rule for rule in egress if any(p["port"] == 53 for p in rule["ports"])]
    # every rule that opens port 53 names its peers: no "53 to anywhere" rule is left
    assert dns == [
        {
            "to": [
                {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": "dns-system"}
                    },
                    "podSelector": {"matchLabels": {"app": "coredns", "tier": "node"}},
                }
            ],
            "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
        }
    ]
    assert all(rule.get("to") for rule in egress)


def test_a_changed_dns_selector_replaces_the_installed_policy(api, actuator, tenant):
    actuator.reconcile(tenant, 1)
    moved = make_actuator(api, replace(SETTINGS, cluster_dns_pod_labels="k8s-app=coredns"))
    moved.reconcile(tenant, 1)
    egress = api.get("networkpolicies", tenant_namespace("acme"), "cloacina-agent")["spec"][
        "egress"
    ]
    assert egress[0]["to"][0]["podSelector"] == {"matchLabels": {"k8s-app": "coredns"}}


def test_turning_the_toggle_off_removes_the_installed_policies(api, actuator, tenant, other_tenant):
    for t in (tenant, other_tenant):
        actuator.reconcile(t, 1)
    ns, other_ns = tenant_namespace("acme"), tenant_namespace("globex")
    assert api.get("networkpolicies", ns, "cloacina-agent") is not None
    # something not ours in the same namespace stays
    api.objects[("networkpolicies", ns, "site-extra")] = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "site-extra", "namespace": ns, "labels": {"team": "ops"}},
        "spec": {"podSelector": {}},
    }
    off = make_actuator(api, replace(SETTINGS, network_policy=False))  # a restart with it off
    off.reconcile(tenant, 1)
    assert api.get("networkpolicies", ns, "cloacina-agent") is None
    assert api.get("networkpolicies", ns, "site-extra") is not None
    assert api.get("networkpolicies", other_ns, "cloacina-agent") is not None  # not reconciled yet
    [delete] = [c for c in api.requests if c.method == "DELETE" and "networkpolicies" in c.path]
    assert delete.path == f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies"
    assert (
        delete.q("labelSelector") == f"cloacina.managed=true,cloacina.tenant={tenant_label('acme')}"
    )
    off.reconcile(tenant, 2)  # once per namespace: no delete on every tick
    assert len([c for c in api.requests if c.method == "DELETE"]) == 1
    # a disabled tenant's namespace is cleared too
    Tenant.objects.filter(pk=other_tenant.pk).update(is_active=False)
    reconcile_all(off)
    assert api.get("networkpolicies", other_ns, "cloacina-agent") is None


def test_an_idle_tenant_gets_no_namespace(api, actuator, tenant):
    actuator.reconcile(tenant, 0)
    assert api.namespaces == {}


def test_disabled_and_deleted_tenants_are_scaled_to_zero(api, actuator, tenant, other_tenant):
    Tenant.objects.filter(pk__in=[tenant.pk, other_tenant.pk]).update(desired_count=2)
    reconcile_all(actuator)
    Tenant.objects.filter(pk=tenant.pk).update(is_active=False)
    other_tenant.delete()
    reconcile_all(actuator)
    for name in ("acme", "globex"):
        ns = tenant_namespace(name)
        assert api.get("deployments", ns, "cloacina-agent")["spec"]["replicas"] == 0
        assert api.get("secrets", ns, "cloacina-agent-key") is None
    assert not ApiKey.objects.filter(tenant=tenant, revoked_at__isnull=True).exists()


# -- in-cluster credentials, end to end over TLS ----------------------------------------
@pytest.fixture
def tls_cluster(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the fake cluster's certificate")
    cert, key = tmp_path / "ca.crt", tmp_path / "tls.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    shutil.copy(cert, sa / "ca.crt")
    (sa / "token").write_text("sa-token-123")
    (sa / "namespace").write_text("cloacina")
    with FakeKubernetesApi(tls=context) as fake:
        yield fake, sa


def test_in_cluster_credentials_drive_the_fake_cluster(tls_cluster, tenant):
    fake, sa = tls_cluster
    env = {
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(fake.port),
        "CLOACINA_FLEET_SERVER_URL": "http://cloacina.cloacina.svc:8000",
        "CLOACINA_SERVER_POD_LABELS": "app.kubernetes.io/name=cloacina",
        "CLOACINA_HOME": "/tmp/cloacina-k8s-test",
    }
    config = load_config({**env, "CLOACINA_FLEET_ACTUATOR": "kubernetes"})
    actuator = build_actuator(config, probe=SubstrateProbe(environ=env, service_account_dir=sa))
    assert isinstance(actuator, KubernetesActuator)
    actuator.reconcile(tenant, 1)
    ns = tenant_namespace("acme")
    assert fake.get("deployments", ns, "cloacina-agent")["spec"]["replicas"] == 1
    assert {c.headers.get("authorization").lower() for c in fake.requests} == {
        "bearer sa-token-123"
    }
    # the server namespace came from the service account's namespace file
    policy = fake.get("networkpolicies", ns, "cloacina-agent")
    selector = policy["spec"]["egress"][1]["to"][0]["namespaceSelector"]["matchLabels"]
    assert selector == {"kubernetes.io/metadata.name": "cloacina"}
