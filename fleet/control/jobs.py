"""Wiring the control plane into `serve`.

At boot ``serve`` calls :func:`build_actuator` (the substrate guard runs here;
a misconfiguration raises ConfigError and the server does not start) and
schedules :func:`control_plane_jobs`: one leader-only job that, every
CLOACINA_AUTOSCALE_INTERVAL_S, runs the autoscaler (unless
CLOACINA_AUTOSCALE=false) and then reconciles every tenant through the actuator.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from datetime import datetime

from fleet.control import substrate
from fleet.control.actuators.base import Actuator, ReconcileResult
from fleet.control.actuators.docker import DockerActuator
from fleet.control.actuators.noop import NoopActuator
from fleet.control.actuators.process import REPO, ProcessActuator
from fleet.control.actuators.settings import ControlSettings, load_control_settings
from fleet.control.autoscaler import autoscale_tick
from fleet.control.leadership import StickyLeadership
from fleet.control.reconciler import reconcile_all
from fleet.engine.executor import PeriodicJob
from fleet.models import AutoscaleDecision, ServerInstance
from fleet.platform.config import Config, ConfigError

log = logging.getLogger(__name__)

JOB_NAME = "fleet_control"


def build_actuator(
    config: Config,
    *,
    server_url: str | None = None,
    settings: ControlSettings | None = None,
    probe: substrate.SubstrateProbe | None = None,
) -> Actuator:
    """Validate the configured actuator's substrate (fail closed) and build it.

    Raises :class:`fleet.platform.config.ConfigError` with a message naming the
    problem.  The built actuator is also remembered for :func:`control_plane_jobs`.
    """
    name = substrate.check_actuator_name(config.fleet_actuator)
    probe = probe or substrate.SubstrateProbe()
    settings = settings or load_control_settings(probe.environ)
    actuator: Actuator
    if name == "none":
        actuator = NoopActuator()
    elif name == "process":
        substrate.guard_process(REPO / "manage.py")
        actuator = ProcessActuator(
            server_url=settings.server_url or server_url,
            max_concurrency=settings.agent_max_concurrency,
            drain_timeout_s=settings.agent_drain_timeout_s,
            log_dir=config.home / "agents",
        )
    elif name == "docker":
        import docker  # lazy: the Docker SDK is optional, needed only by this actuator

        substrate.guard_docker(probe, settings)
        env = dict(probe.environ)
        actuator = DockerActuator(settings, client_factory=lambda: docker.from_env(environment=env))
    else:
        actuator = _build_kubernetes(settings, probe)
    _state.actuator = actuator
    log.info("fleet actuator: %s", actuator.describe())
    return actuator


def _build_kubernetes(settings: ControlSettings, probe: substrate.SubstrateProbe) -> Actuator:
    from kubernetes import client as k8s
    from kubernetes.config.config_exception import ConfigException
    from kubernetes.config.incluster_config import InClusterConfigLoader

    # A local import, like the SDK's above: the actuator imports the optional kubernetes
    # client at module level, so only a server configured for Kubernetes may load it.
    from fleet.control.actuators.kubernetes import KubernetesActuator

    substrate.guard_kubernetes(probe, settings)
    configuration = k8s.Configuration()
    try:
        InClusterConfigLoader(
            token_filename=str(probe.token_path),
            cert_filename=str(probe.ca_path),
            environ=probe.environ,
        ).load_and_set(configuration)
    except ConfigException as exc:
        raise ConfigError(
            f"CLOACINA_FLEET_ACTUATOR=kubernetes refused: in-cluster credentials unusable: {exc}"
        ) from None
    namespace_file = probe.service_account_dir / "namespace"
    own_namespace = namespace_file.read_text().strip() if namespace_file.exists() else None
    return KubernetesActuator(settings, k8s.ApiClient(configuration), own_namespace)


@dataclass
class _State:
    actuator: Actuator | None = None
    leadership: StickyLeadership = field(default_factory=StickyLeadership)
    server_name: str = ""


_state = _State()


def current_actuator() -> Actuator | None:
    return _state.actuator


def bind_server_url(url: str) -> None:
    """Tell the process actuator where `serve` listens (known only once daphne is up)."""
    actuator = _state.actuator
    bind = getattr(actuator, "bind_server", None)
    if bind is not None and not getattr(actuator, "server_url", None):
        bind(url)


def this_server() -> str:
    """This process's ServerInstance id when registered (else host:pid), for logs."""
    if not _state.server_name:
        row = (
            ServerInstance.objects.filter(
                host=socket.gethostname()[:60], pid=os.getpid(), stopped_at__isnull=True
            )
            .values_list("id", flat=True)
            .first()
        )
        _state.server_name = row or f"{socket.gethostname()}:{os.getpid()}"
    return _state.server_name


@dataclass
class TickReport:
    server: str
    decisions: list[AutoscaleDecision]
    reconciled: list[ReconcileResult]


def control_tick(
    actuator: Actuator,
    config: Config,
    leadership: StickyLeadership | None = None,
    now: datetime | None = None,
) -> TickReport | None:
    """One control-plane tick; None when another server is the leader."""
    leadership = leadership or _state.leadership
    was_leader = leadership.held
    if not leadership.hold():
        if was_leader:
            log.warning("fleet control: %s lost the leadership", this_server())
            actuator.leadership_lost()
        return None
    server = this_server()
    if not was_leader:
        log.info("fleet control: server %s is now the leader (actuator %s)", server, actuator.name)
    # (serve's job runner closes stale DB connections around every tick)
    decisions = autoscale_tick(config, now) if config.autoscale else []
    reconciled = reconcile_all(actuator, config.default_max_agents)
    log.debug("fleet control tick by %s: %d decision(s)", server, len(decisions))
    return TickReport(server, decisions, reconciled)


def control_plane_jobs(config: Config) -> list[PeriodicJob]:
    """The leader-only autoscale + reconcile job, every CLOACINA_AUTOSCALE_INTERVAL_S."""
    actuator = _state.actuator or build_actuator(config)
    return [
        PeriodicJob(
            name=JOB_NAME,
            func=lambda: control_tick(actuator, config),
            interval_s=config.autoscale_interval_s,
            leader_only=True,
        )
    ]


def shutdown() -> None:
    """On server stop: let the actuator stop what it started, then give up the leadership."""
    actuator = _state.actuator
    try:
        if actuator is not None:
            actuator.shutdown()
    finally:
        _state.leadership.release()
