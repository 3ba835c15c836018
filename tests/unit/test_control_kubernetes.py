"""The kubernetes actuator: rendered objects validated against the client's schema models,
and the actuator driven against a fake API server at the HTTP boundary.

Here: the unit tests (no database, socket or process); the rest are in tests/integration/test_control_kubernetes.py.
"""

from __future__ import annotations

import copy
import json

import pytest
from kubernetes import client as k8s

from fleet.control.actuators import kubernetes_manifests as m
from fleet.control.actuators.naming import tenant_label, tenant_namespace
from fleet.control.actuators.settings import load_control_settings
from fleet.platform.config import ConfigError
from tests.support.fakes.kubernetes_api import SETTINGS

MODELS = {
    "Deployment": k8s.V1Deployment,
    "NetworkPolicy": k8s.V1NetworkPolicy,
    "Secret": k8s.V1Secret,
    "Namespace": k8s.V1Namespace,
}


def schema_round_trip(obj: dict) -> dict:
    """Parse ``obj`` with the generated (pydantic) model of its kind and serialise it back.

    The models know every field of the Kubernetes OpenAPI schema (release-1.37)
    and validate types and required fields; a field they do not know is dropped,
    so a lossless round trip means no unknown or misspelt fields.
    """
    model = MODELS[obj["kind"]]
    parsed = k8s.ApiClient().deserialize(json.dumps(obj), model.__name__, "application/json")
    assert isinstance(parsed, model)
    return json.loads(parsed.to_json())


# -- rendered objects ------------------------------------------------------------------
def test_the_rendered_objects_match_the_kubernetes_schema():
    label = tenant_label("acme")
    ns = tenant_namespace("acme")
    server = m.server_coordinates(SETTINGS, None)
    for obj in (
        m.render_namespace(ns, label),
        m.render_secret(ns, label, "clk_x_y", "x"),
        m.render_deployment(ns, label, 3, SETTINGS),
        m.render_network_policy(ns, label, server),
    ):
        assert schema_round_trip(obj) == obj, obj["kind"]


def test_the_schema_check_catches_a_misspelt_field():
    dep = m.render_deployment("ns", "l", 1, SETTINGS)
    bad = copy.deepcopy(dep)
    bad["spec"]["template"]["spec"]["securityContext"]["runAsNonRot"] = True
    assert schema_round_trip(bad) != bad
    missing = copy.deepcopy(dep)
    del missing["spec"]["template"]["spec"]["containers"][0]["name"]  # required by the schema
    with pytest.raises(Exception, match="name"):
        schema_round_trip(missing)


def test_the_agent_pod_is_hardened():
    dep = m.render_deployment("ns", "l", 1, SETTINGS)
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "fsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    [c] = pod["containers"]
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert c["resources"] == {
        "requests": {"cpu": "100m", "memory": "256Mi"},
        "limits": {"cpu": "1", "memory": "1Gi"},
    }
    assert {v["name"]: v for v in pod["volumes"]} == {
        "home": {"name": "home", "emptyDir": {}},
        "tmp": {"name": "tmp", "emptyDir": {}},
    }
    assert {v["mountPath"] for v in c["volumeMounts"]} == {"/home/agent", "/tmp"}
    assert {"name": "HOME", "value": "/home/agent"} in c["env"]
    assert {"name": "CLOACINA_HOME", "value": "/home/agent/.cloacina"} in c["env"]
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert probe not in c
    assert pod["automountServiceAccountToken"] is False
    assert pod["terminationGracePeriodSeconds"] == 120
    key_env = next(e for e in c["env"] if e["name"] == "CLOACINA_AGENT_API_KEY")
    assert key_env["valueFrom"] == {
        "secretKeyRef": {"name": "cloacina-agent-key", "key": "api-key"}
    }


def test_a_named_pools_objects_match_the_schema_and_never_overlap_the_default_pool():
    from fleet.control.actuators.base import PoolSpec

    label, ns = tenant_label("acme"), tenant_namespace("acme")
    server = m.server_coordinates(SETTINGS, None)
    spec = PoolSpec("gpu", 2, ("gpu", "pool:gpu"), ("cuda",), 1, "4", "16Gi", 1)
    dep = m.render_deployment(ns, label, 2, SETTINGS, spec)
    for obj in (
        m.render_secret(ns, label, "clk_x_y", "x", "gpu"),
        dep,
        m.render_network_policy(ns, label, server, pool="gpu"),
    ):
        assert schema_round_trip(obj) == obj, obj["kind"]
    assert dep["metadata"]["name"] == "cloacina-agent-gpu"
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["cloacina.io/pool"] == "gpu"
    default_selector = m.render_deployment(ns, label, 1, SETTINGS)["spec"]["selector"]
    # The default Deployment's selector must not adopt the GPU pool's pods.
    assert not all(pod_labels.get(k) == v for k, v in default_selector["matchLabels"].items())
    [container] = dep["spec"]["template"]["spec"]["containers"]
    assert container["args"][-6:] == [
        "--max-concurrency", "1", "--tags", "gpu,pool:gpu", "--capabilities", "cuda",
    ]  # fmt: skip
    assert container["resources"] == {
        "requests": {"cpu": "4", "memory": "16Gi"},
        "limits": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"},
    }
    secret_ref = container["env"][1]["valueFrom"]["secretKeyRef"]
    assert secret_ref["name"] == "cloacina-agent-key-gpu"


def test_a_policy_with_dns_but_no_selector_is_a_boot_error(tmp_path):
    # An empty variable means "unset" (the default applies); config.toml can say "" though.
    env = {"CLOACINA_HOME": str(tmp_path)}
    assert load_control_settings(env | {"CLOACINA_CLUSTER_DNS_POD_LABELS": ""}).cluster_dns() == (
        "kube-system",
        {"k8s-app": "kube-dns"},
    )
    (tmp_path / "config.toml").write_text('[server]\ncluster_dns_pod_labels = ""\n')
    with pytest.raises(ConfigError, match="CLOACINA_CLUSTER_DNS_POD_LABELS"):
        load_control_settings(env)
    off = load_control_settings(env | {"CLOACINA_FLEET_NETWORK_POLICY": "false"})
    assert off.network_policy is False  # no policy, no DNS selector needed
    with pytest.raises(ConfigError, match="k=v pairs"):
        load_control_settings(env | {"CLOACINA_CLUSTER_DNS_POD_LABELS": "kube-dns"})
