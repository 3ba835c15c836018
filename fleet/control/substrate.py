"""Substrate guards: refuse to boot with an actuator whose substrate is absent or wrong.

A misconfigured actuator must be a loud boot error, never silent wrong
scaling.  Every input (environment, service-account paths, the Docker ping)
is injectable through :class:`SubstrateProbe`, so each refusal is testable
without a cluster or a daemon.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fleet.control.actuators.settings import ControlSettings
from fleet.platform.config import ConfigError

ACTUATORS = ("none", "process", "docker", "kubernetes")
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DOCKER_PING_TIMEOUT_S = 5


def _default_docker_ping(environ: Mapping[str, str]) -> str:
    """Ping the daemon the docker SDK would use for ``environ``; return its address."""
    import docker

    client = docker.from_env(environment=dict(environ), timeout=DOCKER_PING_TIMEOUT_S)
    try:
        client.ping()
        return client.api.base_url
    finally:
        client.close()


@dataclass(frozen=True)
class SubstrateProbe:
    """What the guards look at; defaults read the real process environment and filesystem."""

    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    service_account_dir: Path = SERVICE_ACCOUNT_DIR
    docker_ping: Callable[[Mapping[str, str]], str] = _default_docker_ping

    @property
    def token_path(self) -> Path:
        return self.service_account_dir / "token"

    @property
    def ca_path(self) -> Path:
        return self.service_account_dir / "ca.crt"

    def kubernetes_signs(self) -> list[str]:
        """Evidence that this process runs inside a Kubernetes pod."""
        signs = []
        if self.environ.get("KUBERNETES_SERVICE_HOST"):
            signs.append("KUBERNETES_SERVICE_HOST is set")
        if self.token_path.exists():
            signs.append(f"a service-account token is mounted at {self.token_path}")
        return signs


def check_actuator_name(name: str) -> str:
    if name not in ACTUATORS:
        raise ConfigError(
            f"CLOACINA_FLEET_ACTUATOR: unknown actuator {name!r}; valid: {', '.join(ACTUATORS)}"
        )
    return name


def guard_docker(probe: SubstrateProbe, settings: ControlSettings) -> str:
    """Refuse inside Kubernetes or without a reachable daemon; return the daemon's address."""
    signs = probe.kubernetes_signs()
    if signs:
        raise ConfigError(
            "CLOACINA_FLEET_ACTUATOR=docker refused: this server runs inside Kubernetes ("
            + "; ".join(signs)
            + "). Scaling throwaway containers there would be silently wrong; "
            "use CLOACINA_FLEET_ACTUATOR=kubernetes."
        )
    if not settings.server_url:
        raise ConfigError(
            "CLOACINA_FLEET_ACTUATOR=docker needs CLOACINA_FLEET_SERVER_URL: the URL the agent "
            "containers use to reach this server (127.0.0.1 is the container itself, unless "
            "CLOACINA_DOCKER_NETWORK=host)."
        )
    try:
        return probe.docker_ping(probe.environ)
    except Exception as exc:  # the SDK raises DockerException, requests errors, OSError …
        where = probe.environ.get("DOCKER_HOST") or "the default socket /var/run/docker.sock"
        raise ConfigError(
            f"CLOACINA_FLEET_ACTUATOR=docker refused: no Docker daemon reachable at {where} "
            f"({type(exc).__name__}: {exc}). Start Docker or set DOCKER_HOST."
        ) from None


def guard_kubernetes(probe: SubstrateProbe, settings: ControlSettings) -> None:
    """Refuse unless in-cluster credentials are present (the actuator uses nothing else)."""
    missing = []
    for var in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        if not probe.environ.get(var):
            missing.append(f"{var} is not set")
    for path in (probe.token_path, probe.ca_path):
        if not path.exists():
            missing.append(f"{path} does not exist")
    if missing:
        raise ConfigError(
            "CLOACINA_FLEET_ACTUATOR=kubernetes refused: this server is not running in a "
            "Kubernetes cluster (" + "; ".join(missing) + "). It needs in-cluster credentials."
        )
    if not settings.server_url:
        raise ConfigError(
            "CLOACINA_FLEET_ACTUATOR=kubernetes needs CLOACINA_FLEET_SERVER_URL: the in-cluster "
            "URL agent pods use to reach the server (e.g. http://cloacina.cloacina.svc:8000)."
        )


def guard_process(manage_py: Path) -> None:
    if not manage_py.is_file():
        raise ConfigError(
            f"CLOACINA_FLEET_ACTUATOR=process refused: {manage_py} not found; the process "
            "actuator starts `python manage.py runagent` from the server's source tree."
        )
