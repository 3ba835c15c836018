"""deploy/kubernetes and the Dockerfile, checked by reading: every manifest validates against the
Kubernetes schema models, every knob is one the server knows, and the pieces agree."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s

from fleet.control.actuators.settings import CONTROL_SETTINGS, ControlSettings
from fleet.platform.config import SETTINGS

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "kubernetes"
MODELS = {
    "Namespace": k8s.V1Namespace,
    "ServiceAccount": k8s.V1ServiceAccount,
    "ClusterRole": k8s.V1ClusterRole,
    "ClusterRoleBinding": k8s.V1ClusterRoleBinding,
    "ConfigMap": k8s.V1ConfigMap,
    "Secret": k8s.V1Secret,
    "Deployment": k8s.V1Deployment,
    "Service": k8s.V1Service,
    "PodDisruptionBudget": k8s.V1PodDisruptionBudget,
}


def documents() -> list[dict]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def by_kind(kind: str) -> list[dict]:
    return [d for d in documents() if d["kind"] == kind]


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_matches_the_kubernetes_schema(doc):
    model = MODELS[doc["kind"]]
    parsed = k8s.ApiClient().deserialize(json.dumps(doc), model.__name__, "application/json")
    round_trip = json.loads(parsed.to_json())
    if doc["kind"] == "Secret":  # stringData is write-only input; the model keeps it as is
        assert round_trip["stringData"] == doc["stringData"]
    assert round_trip == doc


def test_the_kustomization_lists_every_manifest_but_the_secret_example():
    listed = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"]
    on_disk = {p.name for p in DEPLOY.glob("*.yaml")} - {
        "kustomization.yaml",
        "secret.example.yaml",
    }
    assert sorted(listed) == sorted(on_disk)


def test_every_configured_knob_is_one_the_server_reads():
    [config_map] = by_kind("ConfigMap")
    known = {s.env for s in SETTINGS} | {s.env for s in CONTROL_SETTINGS}
    assert set(config_map["data"]) <= known, set(config_map["data"]) - known


def test_the_network_policy_coordinates_match_the_server():
    data = by_kind("ConfigMap")[0]["data"]
    [server] = [d for d in by_kind("Deployment") if d["metadata"]["name"] == "cloacina-server"]
    [service] = by_kind("Service")
    settings = ControlSettings(
        server_url=data["CLOACINA_FLEET_SERVER_URL"],
        server_pod_labels=data["CLOACINA_SERVER_POD_LABELS"],
        server_port=int(data["CLOACINA_SERVER_PORT"]),
    )
    pod_labels = server["spec"]["template"]["metadata"]["labels"]
    assert settings.pod_labels().items() <= pod_labels.items()
    assert data["CLOACINA_SERVER_NAMESPACE"] == server["metadata"]["namespace"]
    [container] = server["spec"]["template"]["spec"]["containers"]
    assert container["ports"][0]["containerPort"] == settings.server_port
    assert service["spec"]["ports"][0]["port"] == 8000
    # the URL agents use resolves to that Service in that namespace, on that port
    assert data["CLOACINA_FLEET_SERVER_URL"] == (
        f"http://{service['metadata']['name']}.{service['metadata']['namespace']}.svc:8000"
    )


def test_the_cluster_role_grants_what_the_actuator_calls():
    [role] = by_kind("ClusterRole")
    grants = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    needed = {
        ("", "namespaces", "get"), ("", "namespaces", "list"), ("", "namespaces", "create"),
        ("", "secrets", "get"), ("", "secrets", "create"), ("", "secrets", "update"),
        ("", "secrets", "delete"), ("", "pods", "list"),
        ("apps", "deployments", "get"), ("apps", "deployments", "create"),
        ("apps", "deployments/scale", "patch"),
        ("networking.k8s.io", "networkpolicies", "get"),
        ("networking.k8s.io", "networkpolicies", "create"),
        ("networking.k8s.io", "networkpolicies", "update"),
        ("networking.k8s.io", "networkpolicies", "deletecollection"),
    }  # fmt: skip
    assert grants == needed  # exactly: nothing missing, nothing extra


def test_the_server_pod_is_hardened_and_uses_the_service_account():
    [server] = [d for d in by_kind("Deployment") if d["metadata"]["name"] == "cloacina-server"]
    pod = server["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == by_kind("ServiceAccount")[0]["metadata"]["name"]
    assert pod["securityContext"]["runAsUser"] == 10001 and pod["securityContext"]["runAsNonRoot"]
    [c] = pod["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/data", "/tmp"} <= mounts  # $CLOACINA_HOME and /tmp stay writable


def test_the_dockerfile_builds_a_non_root_image_running_serve():
    text = (REPO / "Dockerfile").read_text()
    # The base is a build argument (scripts/build-agent-image passes a local Debian one);
    # users get python:3.11-slim.
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert re.search(r"^USER 10001:10001$", text, re.M)
    assert 'ENTRYPOINT ["python", "manage.py"]' in text
    assert 'CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]' in text
    assert "pip install -r requirements.txt" in text


def test_the_dockerfile_leaves_the_pip_ca_secret_out_of_the_image():
    text = (REPO / "Dockerfile").read_text()
    # a BuildKit secret mount on the pip step only: never COPY'd, never an ENV or ARG
    assert "--mount=type=secret,id=pip_ca" in text
    assert "PIP_CERT=/run/secrets/pip_ca" in text
    assert not re.search(r"^(ENV|ARG|COPY).*pip_ca", text, re.M)
