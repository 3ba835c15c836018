"""The Actuator interface: make the real number of a tenant's agents match desired_count.

An actuator owns the mechanism only (processes, containers, a Deployment); the
number comes from the control plane.  Every call is scoped to one tenant,
identified on the substrate by its label (:func:`fleet.control.actuators.naming.tenant_label`),
so an actuator never lists, starts or stops another tenant's agents.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from fleet.control.actuators.naming import tenant_label
from fleet.executors.fleet import lifecycle
from fleet.models import ApiKey, Role, Tenant


@dataclass(frozen=True)
class AgentHandle:
    """One agent as the substrate sees it (a process, a container, a pod)."""

    name: str
    tenant_label: str
    ident: str  # pid, container id, pod name
    state: str = "running"  # running | draining
    key_lookup: str = ""


@dataclass
class ReconcileResult:
    tenant_label: str
    desired: int
    actual: int  # agents running (not draining) before this pass
    started: int = 0
    stopped: int = 0  # asked to drain
    restarted: int = 0  # replacements for crashed agents
    notes: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.started or self.stopped or self.restarted)


def label_of(tenant: Tenant | str) -> str:
    return tenant if isinstance(tenant, str) else tenant_label(tenant.name)


def mint_agent_key(tenant: Tenant, label: str) -> tuple[ApiKey, str]:
    """A fresh tenant-scoped agent key for one spawned agent (or one Deployment)."""
    return ApiKey.mint(Role.AGENT, tenant=tenant, label=label[:200])


def revoke_keys(lookups: list[str] | set[str]) -> int:
    """Revoke minted keys by their public lookup part (already revoked or deleted ones are
    skipped) and retire the agents registered with them (:mod:`fleet.executors.fleet.lifecycle`)."""
    if not lookups:
        return 0
    return lifecycle.revoke_keys(lookups)


class Actuator(abc.ABC):
    name: str = ""

    @abc.abstractmethod
    def actual(self, tenant: Tenant | str) -> list[AgentHandle]:
        """The tenant's agents that are running and not draining."""

    @abc.abstractmethod
    def reconcile(self, tenant: Tenant, desired: int) -> ReconcileResult:
        """Start or drain agents until ``desired`` run; replace crashed ones; revoke dead keys."""

    @abc.abstractmethod
    def stop_all(self, tenant: Tenant | str) -> int:
        """Stop every agent of a disabled or deleted tenant; return how many were stopped."""

    @abc.abstractmethod
    def managed_labels(self) -> set[str]:
        """Labels of every tenant this actuator has agents for (to find deleted tenants)."""

    def leadership_lost(self) -> None:  # noqa: B027 - optional hook
        """This process no longer drives the fleet: give up what only the leader may hold."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """The server is stopping."""

    def describe(self) -> str:
        return self.name
