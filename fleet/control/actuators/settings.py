"""The actuators' own knobs (image, agent resources, server coordinates, …).

Read with the same precedence as every other setting (environment variable >
``[server]`` table of ``$CLOACINA_HOME/config.toml`` > default) through the
shared machinery of :mod:`fleet.platform.config`; they live here because only
the control plane uses them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from fleet.platform.config import AGENT_DRAIN_TIMEOUT, ConfigError, Setting, read_settings

# CoreDNS and kube-dns both keep the kube-dns label for compatibility.
DEFAULT_DNS_NAMESPACE = "kube-system"
DEFAULT_DNS_POD_LABELS = "k8s-app=kube-dns"

CONTROL_SETTINGS: tuple[Setting, ...] = (
    # The URL agents use to reach the server.  The process actuator defaults to
    # the loopback address `serve` listens on; docker and kubernetes need it set.
    Setting("server_url", "CLOACINA_FLEET_SERVER_URL", "fleet_server_url", str, ""),
    Setting("agent_image", "CLOACINA_AGENT_IMAGE", "agent_image", str, "cloacina:latest"),
    Setting(
        "agent_image_pull_policy",
        "CLOACINA_AGENT_IMAGE_PULL_POLICY",
        "agent_image_pull_policy",
        str,
        "IfNotPresent",
    ),
    Setting(
        "agent_max_concurrency",
        "CLOACINA_AGENT_MAX_CONCURRENCY",
        "agent_max_concurrency",
        int,
        4,
        1,
    ),
    Setting("agent_cpu_request", "CLOACINA_AGENT_CPU_REQUEST", "agent_cpu_request", str, "250m"),
    Setting("agent_cpu_limit", "CLOACINA_AGENT_CPU_LIMIT", "agent_cpu_limit", str, "2"),
    # The agent runs CPython and tenant code: a generous memory limit avoids OOM kills.
    Setting(
        "agent_memory_request",
        "CLOACINA_AGENT_MEMORY_REQUEST",
        "agent_memory_request",
        str,
        "512Mi",
    ),
    Setting("agent_memory_limit", "CLOACINA_AGENT_MEMORY_LIMIT", "agent_memory_limit", str, "2Gi"),
    # How long a stopped agent may take to finish its in-flight work before it is killed:
    # the server's own setting (the drain the API and console ask for), read once.
    AGENT_DRAIN_TIMEOUT,
    Setting("docker_network", "CLOACINA_DOCKER_NETWORK", "docker_network", str, ""),
    Setting("network_policy", "CLOACINA_FLEET_NETWORK_POLICY", "fleet_network_policy", bool, True),
    # Where the server pods run, for the tenant NetworkPolicy's egress rule.
    Setting("server_namespace", "CLOACINA_SERVER_NAMESPACE", "server_namespace", str, ""),
    Setting("server_pod_labels", "CLOACINA_SERVER_POD_LABELS", "server_pod_labels", str, ""),
    Setting("server_port", "CLOACINA_SERVER_PORT", "server_port", int, 0),
    # The cluster DNS pods, the only DNS the tenant NetworkPolicy lets agents reach.
    Setting(
        "cluster_dns_namespace",
        "CLOACINA_CLUSTER_DNS_NAMESPACE",
        "cluster_dns_namespace",
        str,
        DEFAULT_DNS_NAMESPACE,
    ),
    Setting(
        "cluster_dns_pod_labels",
        "CLOACINA_CLUSTER_DNS_POD_LABELS",
        "cluster_dns_pod_labels",
        str,
        DEFAULT_DNS_POD_LABELS,
    ),
)

# Kubernetes resource quantities (the settings' format, shared by the docker actuator).
_QUANTITY = re.compile(r"(\d+(?:\.\d+)?)(m|k|M|G|T|Ki|Mi|Gi|Ti)?")
_MEMORY_UNITS = {
    None: 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}
# cgroup v1 cpu.shares for one CPU, and its floor: what the kubelet maps a CPU request to.
CPU_SHARES_PER_CORE = 1024
MIN_CPU_SHARES = 2


def memory_bytes(variable: str, value: str) -> int:
    """A memory quantity ("512Mi", "2Gi", "1G", "1048576") in bytes; ConfigError otherwise."""
    match = _QUANTITY.fullmatch(value.strip())
    if not match or match.group(2) == "m":
        raise ConfigError(f"{variable} must be a memory quantity like 512Mi or 2Gi, got {value!r}")
    amount = int(float(match.group(1)) * _MEMORY_UNITS[match.group(2)])
    if amount <= 0:
        raise ConfigError(f"{variable} must be more than 0 bytes, got {value!r}")
    return amount


def cpu_millis(variable: str, value: str) -> int:
    """A CPU quantity ("250m", "2", "0.5") in thousandths of a CPU; ConfigError otherwise."""
    match = _QUANTITY.fullmatch(value.strip())
    if not match or match.group(2) not in (None, "m"):
        raise ConfigError(f"{variable} must be a CPU quantity like 250m or 2, got {value!r}")
    millis = float(match.group(1)) * (1 if match.group(2) == "m" else 1000)
    if millis < 1:
        raise ConfigError(f"{variable} must be at least 1m, got {value!r}")
    return int(millis)


SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@dataclass(frozen=True)
class ControlSettings:
    server_url: str = ""
    agent_image: str = "cloacina:latest"
    agent_image_pull_policy: str = "IfNotPresent"
    agent_max_concurrency: int = 4
    agent_cpu_request: str = "250m"
    agent_cpu_limit: str = "2"
    agent_memory_request: str = "512Mi"
    agent_memory_limit: str = "2Gi"
    agent_drain_timeout_s: float = 300.0
    docker_network: str = ""
    network_policy: bool = True
    server_namespace: str = ""
    server_pod_labels: str = ""
    server_port: int = 0
    cluster_dns_namespace: str = DEFAULT_DNS_NAMESPACE
    cluster_dns_pod_labels: str = DEFAULT_DNS_POD_LABELS

    def pod_labels(self) -> dict[str, str]:
        """``CLOACINA_SERVER_POD_LABELS`` ("k=v,k2=v2") as a dict; ConfigError when malformed."""
        return parse_labels(self.server_pod_labels, "CLOACINA_SERVER_POD_LABELS")

    def cluster_dns(self) -> tuple[str, dict[str, str]]:
        """(namespace, pod labels) of the cluster DNS pods; ConfigError when either is missing.

        Both must be set: an empty pod selector would open port 53 to every pod of the
        namespace, an empty namespace would not select the DNS at all.
        """
        labels = parse_labels(self.cluster_dns_pod_labels, "CLOACINA_CLUSTER_DNS_POD_LABELS")
        if not self.cluster_dns_namespace or not labels:
            raise ConfigError(
                "CLOACINA_CLUSTER_DNS_NAMESPACE and CLOACINA_CLUSTER_DNS_POD_LABELS must both be "
                f"set (defaults {DEFAULT_DNS_NAMESPACE!r} and {DEFAULT_DNS_POD_LABELS!r})"
            )
        return self.cluster_dns_namespace, labels

    def container_resources(self) -> dict[str, int]:
        """The CPU/memory settings as Docker's HostConfig keywords (docker SDK names).

        Limits are hard (``nano_cpus``, ``mem_limit``); the requests map as the kubelet maps
        them: the memory request to a soft reservation, the CPU request to cpu.shares.
        """
        return {
            "nano_cpus": cpu_millis("CLOACINA_AGENT_CPU_LIMIT", self.agent_cpu_limit) * 10**6,
            "cpu_shares": max(
                MIN_CPU_SHARES,
                cpu_millis("CLOACINA_AGENT_CPU_REQUEST", self.agent_cpu_request)
                * CPU_SHARES_PER_CORE
                // 1000,
            ),
            "mem_limit": memory_bytes("CLOACINA_AGENT_MEMORY_LIMIT", self.agent_memory_limit),
            "mem_reservation": memory_bytes(
                "CLOACINA_AGENT_MEMORY_REQUEST", self.agent_memory_request
            ),
        }

    def effective_server_port(self) -> int:
        """The server port agents connect to: explicit, else the one in the server URL."""
        if self.server_port:
            return self.server_port
        if not self.server_url:
            return 0
        parsed = urlparse(self.server_url)
        if parsed.port:
            return parsed.port
        return {"http": 80, "https": 443}.get(parsed.scheme, 0)


def parse_labels(raw: str, variable: str) -> dict[str, str]:
    """ "k=v,k2=v2" as a dict; ConfigError naming ``variable`` when an item is not k=v."""
    labels: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in raw.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{variable} must be k=v pairs separated by commas, got {item!r}")
        labels[key.strip()] = value.strip()
    return labels


def load_control_settings(environ: dict | None = None) -> ControlSettings:
    _home, values = read_settings(CONTROL_SETTINGS, environ)
    settings = ControlSettings(**values)
    if settings.server_url:
        parsed = urlparse(settings.server_url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ConfigError(
                f"CLOACINA_FLEET_SERVER_URL must be an http(s):// URL, got {settings.server_url!r}"
            )
    settings.pod_labels()  # validate early: a typo is a boot error, not a silent policy skip
    settings.container_resources()  # likewise a malformed CPU or memory quantity
    if settings.network_policy:
        settings.cluster_dns()  # likewise: a policy without DNS would break every agent
    return settings
