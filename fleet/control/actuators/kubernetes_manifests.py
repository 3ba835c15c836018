"""The Kubernetes objects the kubernetes actuator creates, rendered as plain API dicts.

Pure functions of the tenant label and :class:`ControlSettings`, so tests can
validate every object against the client's generated (pydantic, extra=forbid)
models without a cluster.

The agent pod is hardened to pass a PodSecurity ``restricted`` namespace:
uid/gid 10001, runAsNonRoot, seccomp RuntimeDefault, all capabilities dropped,
no privilege escalation, a read-only root filesystem with emptyDir volumes for
$HOME and /tmp.  It has no probes: the agent serves nothing, and the server
tracks its liveness by heartbeat.
"""

from __future__ import annotations

import base64
import logging
import math

from fleet.control.actuators.base import PoolSpec
from fleet.control.actuators.settings import ControlSettings
from fleet.models import DEFAULT_POOL

log = logging.getLogger(__name__)

AGENT_NAME = "cloacina-agent"  # the Deployment, its container's app label and the NetworkPolicy
SECRET_NAME = "cloacina-agent-key"
SECRET_KEY = "api-key"
KEY_ANNOTATION = "cloacina.io/key-lookup"
MANAGED_LABEL = "cloacina.managed"
TENANT_LABEL = "cloacina.tenant"
APP_LABEL = "app.kubernetes.io/name"
AGENT_UID = 10001
HOME = "/home/agent"


POOL_LABEL = "cloacina.io/pool"  # on a named pool's objects; none: the default pool


def deployment_name(pool: str = DEFAULT_POOL) -> str:
    """The default pool's Deployment is ``cloacina-agent`` (as before pools); a named pool's
    ``cloacina-agent-<pool>``.  Also its pods' app label and its NetworkPolicy's name, so
    no Deployment's selector ever matches another pool's pods."""
    return AGENT_NAME if pool == DEFAULT_POOL else f"{AGENT_NAME}-{pool}"


def secret_name(pool: str = DEFAULT_POOL) -> str:
    """Each pool's agents share one key, in their own Secret (rotated with their rollout)."""
    return SECRET_NAME if pool == DEFAULT_POOL else f"{SECRET_NAME}-{pool}"


def agent_labels(label: str, pool: str = DEFAULT_POOL) -> dict[str, str]:
    labels = {
        APP_LABEL: deployment_name(pool),
        "app.kubernetes.io/managed-by": "cloacina",
        MANAGED_LABEL: "true",
        TENANT_LABEL: label,
    }
    if pool != DEFAULT_POOL:
        labels[POOL_LABEL] = pool
    return labels


def render_namespace(name: str, label: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": name,
            "labels": {
                MANAGED_LABEL: "true",
                TENANT_LABEL: label,
                # The pods below are built to pass it; enforce it so nothing weaker slips in.
                "pod-security.kubernetes.io/enforce": "restricted",
            },
        },
    }


def render_secret(
    namespace: str, label: str, token: str, lookup: str, pool: str = DEFAULT_POOL
) -> dict:
    labels = {MANAGED_LABEL: "true", TENANT_LABEL: label}
    if pool != DEFAULT_POOL:
        labels[POOL_LABEL] = pool
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": secret_name(pool),
            "namespace": namespace,
            "labels": labels,
            "annotations": {KEY_ANNOTATION: lookup},  # the public half only, to revoke it later
        },
        "type": "Opaque",
        "data": {SECRET_KEY: base64.b64encode(token.encode()).decode()},
    }


def pool_resources(spec: PoolSpec, s: ControlSettings) -> dict:
    """Requests and limits of one agent container: the pool's CPU and memory (request =
    limit: a pool says what each agent gets) else the platform's CLOACINA_AGENT_*; GPUs as
    ``nvidia.com/gpu`` limits (the device plugin's resource)."""
    requests = {
        "cpu": spec.cpu or s.agent_cpu_request,
        "memory": spec.memory or s.agent_memory_request,
    }
    limits = {"cpu": spec.cpu or s.agent_cpu_limit, "memory": spec.memory or s.agent_memory_limit}
    if spec.gpu:
        limits["nvidia.com/gpu"] = str(spec.gpu)
    return {"requests": requests, "limits": limits}


def render_deployment(
    namespace: str, label: str, replicas: int, s: ControlSettings, spec: PoolSpec | None = None
) -> dict:
    spec = spec or PoolSpec()
    name = deployment_name(spec.name)
    labels = agent_labels(label, spec.name)
    container = {
        "name": "agent",
        "image": s.agent_image,
        "imagePullPolicy": s.agent_image_pull_policy,
        "args": [
            "runagent",
            "--server",
            s.server_url,
            "--name",
            "$(POD_NAME)",  # expanded by the kubelet: one roster name per pod
            *spec.runagent_args(s.agent_max_concurrency),
        ],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {
                "name": "CLOACINA_AGENT_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": secret_name(spec.name), "key": SECRET_KEY}},
            },
            {"name": "CLOACINA_SERVER_URL", "value": s.server_url},
            {"name": "HOME", "value": HOME},
            # runagent unpacks packages under $CLOACINA_HOME: keep it on the writable volume.
            {"name": "CLOACINA_HOME", "value": f"{HOME}/.cloacina"},
        ],
        "resources": pool_resources(spec, s),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": AGENT_UID,
            "runAsGroup": AGENT_UID,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [
            {"name": "home", "mountPath": HOME},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {APP_LABEL: name, TENANT_LABEL: label}},
            # Never drop below the requested capacity while pods are replaced.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "automountServiceAccountToken": False,  # agents never call the cluster API
                    "enableServiceLinks": False,
                    # SIGTERM → runagent drains; this is how long it may take.
                    "terminationGracePeriodSeconds": math.ceil(s.agent_drain_timeout_s),
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": AGENT_UID,
                        "runAsGroup": AGENT_UID,
                        "fsGroup": AGENT_UID,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [container],
                    "volumes": [
                        {"name": "home", "emptyDir": {}},
                        {"name": "tmp", "emptyDir": {}},
                    ],
                },
            },
        },
    }


def server_coordinates(
    s: ControlSettings, default_namespace: str | None
) -> tuple[str, dict[str, str], int] | None:
    """(namespace, pod labels, port) of the server pods, or None when any part is unknown."""
    namespace = s.server_namespace or default_namespace or ""
    labels = s.pod_labels()
    port = s.effective_server_port()
    if not (namespace and labels and port):
        return None
    return namespace, labels, port


def _pods_in(namespace: str, labels: dict[str, str]) -> dict:
    """A NetworkPolicy peer: the pods with ``labels`` in the namespace named ``namespace``."""
    return {
        # Kubernetes labels every namespace with its own name (since 1.21).
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        "podSelector": {"matchLabels": dict(labels)},
    }


def render_network_policy(
    namespace: str,
    label: str,
    server: tuple[str, dict[str, str], int],
    dns: tuple[str, dict[str, str]] | None = None,
    pool: str = DEFAULT_POOL,
) -> dict:
    """Deny all ingress; egress only to the cluster DNS pods (53 UDP+TCP) and the server pods.

    ``dns`` is (namespace, pod labels) of the cluster DNS, by default kube-system's
    ``k8s-app=kube-dns`` pods: port 53 anywhere else would be an open tunnel out.  One
    policy per pool (its pods' app label), named like the pool's Deployment.
    """
    dns_ns, dns_labels = dns or ControlSettings().cluster_dns()
    server_ns, server_labels, server_port = server
    name = deployment_name(pool)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {MANAGED_LABEL: "true", TENANT_LABEL: label},
        },
        "spec": {
            "podSelector": {"matchLabels": {APP_LABEL: name}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [],
            "egress": [
                {
                    "to": [_pods_in(dns_ns, dns_labels)],
                    "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
                },
                {
                    "to": [_pods_in(server_ns, server_labels)],
                    "ports": [{"protocol": "TCP", "port": server_port}],
                },
            ],
        },
    }
