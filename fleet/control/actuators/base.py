"""The Actuator interface: make the real number of a tenant's agents match desired_count,
pool by pool (:class:`PoolSpec`).

An actuator owns the mechanism only (processes, containers, a Deployment); the
number comes from the control plane.  Every call is scoped to one tenant,
identified on the substrate by its label (:func:`fleet.control.actuators.naming.tenant_label`),
so an actuator never lists, starts or stops another tenant's agents.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from fleet.control.actuators.naming import tenant_label
from fleet.executors.fleet import lifecycle
from fleet.models import DEFAULT_POOL, AgentPool, ApiKey, Role, Tenant


@dataclass(frozen=True)
class AgentHandle:
    """One agent as the substrate sees it (a process, a container, a pod)."""

    name: str
    tenant_label: str
    ident: str  # pid, container id, pod name
    state: str = "running"  # running | draining
    key_lookup: str = ""
    pool: str = DEFAULT_POOL


@dataclass(frozen=True)
class PoolSpec:
    """One agent pool as an actuator starts it: how many, and with which labels.

    ``tags`` already carry the pool's membership tag (``pool:<name>``) for a named pool,
    so the roster knows which pool a registered agent belongs to.  Empty ``cpu`` /
    ``memory`` and a null ``max_concurrency``: the platform's CLOACINA_AGENT_* values.
    """

    name: str = DEFAULT_POOL
    desired: int = 0
    tags: tuple[str, ...] = ()
    capabilities: tuple[str, ...] = ()
    max_concurrency: int | None = None
    cpu: str = ""
    memory: str = ""
    gpu: int = 0

    @classmethod
    def of(cls, pool: AgentPool, desired: int) -> PoolSpec:
        return cls(
            name=pool.name,
            desired=desired,
            tags=tuple(pool.agent_tags()),
            capabilities=tuple(pool.capabilities or ()),
            max_concurrency=pool.max_concurrency,
            cpu=pool.cpu,
            memory=pool.memory,
            gpu=pool.gpu,
        )

    @property
    def is_default(self) -> bool:
        return self.name == DEFAULT_POOL

    def runagent_args(self, default_max_concurrency: int) -> list[str]:
        """What ``runagent`` gets after ``--server`` and ``--name`` for an agent of this pool."""
        args = ["--max-concurrency", str(self.max_concurrency or default_max_concurrency)]
        if self.tags:
            args += ["--tags", ",".join(self.tags)]
        if self.capabilities:
            args += ["--capabilities", ",".join(self.capabilities)]
        return args


def pool_specs(desired: int | Sequence[PoolSpec]) -> list[PoolSpec]:
    """What ``reconcile`` was asked for, as pools: a bare count is the default pool alone."""
    if isinstance(desired, int):
        return [PoolSpec(DEFAULT_POOL, desired)]
    return list(desired)


Agent = TypeVar("Agent")  # an actuator's handle on one agent: a child process, a container


@dataclass(frozen=True)
class PoolPlan(Generic[Agent]):
    """What one pool's reconcile does: crashed agents to replace under their own names
    (the new registration supersedes the stale roster row, so their work is reclaimed at
    once), how many new agents to start, and the running ones to drain (the newest)."""

    replace: list[Agent]
    start: int
    drain: list[Agent]


def plan_pool(
    desired: int, running: list[Agent], crashed: list[Agent], age: Callable[[Agent], int]
) -> PoolPlan[Agent]:
    """The process and docker actuators' shared arithmetic for one pool: ``running`` and
    ``crashed`` are that pool's agents, ``age`` orders them (larger: newer)."""
    missing = max(desired - len(running), 0)
    replace = crashed[:missing]
    surplus = max(len(running) - desired, 0)
    drain = sorted(running, key=age, reverse=True)[:surplus]
    return PoolPlan(replace, missing - len(replace), drain)


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
    def reconcile(self, tenant: Tenant, desired: int | Sequence[PoolSpec]) -> ReconcileResult:
        """Start or drain agents until each pool runs its count (a bare count: the default
        pool, unlabelled); replace crashed ones; stop the agents of pools not named (deleted
        pools); revoke dead keys.  An agent with no pool label on the substrate is the
        default pool's (so agents started before pools existed are adopted)."""

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
