"""Which of a tenant's agent pools could run a task: the static selectors, judged on labels.

A pool's agents are started with its tags (plus ``pool:<name>``), its capabilities and,
for GPU pools, GPUs (:mod:`fleet.models.pools`).  So whether a pool *could* run a task is
the static half of the task's selectors (:mod:`fleet.executors.fleet.routing.selectors`)
asked of those labels instead of a live agent's row:

* ``agent`` (a direct name): never — a pool does not promise a name;
* ``tags``: all of them among the pool's agent tags;
* ``capability``: among the pool's capabilities;
* ``gpu = true`` (or a free-VRAM floor): the pool starts agents with a GPU; a named GPU
  model: never (what model a GPU pool gets is known only once its agent reports it).

The dynamic selectors (free memory, CPU, VRAM now) say nothing about whether it *could*.
Two users: the autoscaler, which counts a Ready task toward the first pool that could run
it (default first, then the named pools in creation order), and selection, which makes a
task wait instead of failing NoMatchingAgent while a pool that could run it can still grow.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta

from django.db.models import Sum
from django.utils import timezone

from agents.models import Agent, AgentState
from fleet.executors.fleet.routing.selectors import Selectors
from fleet.models import DEFAULT_POOL, AgentPool, Tenant
from fleet.models.pools import POOL_TAG_PREFIX
from fleet.platform.config import get_config

NO_ACTUATOR = "none"  # CLOACINA_FLEET_ACTUATOR: agents are run by hand


@dataclass(frozen=True)
class PoolLabels:
    """What a pool's agents are started with (the part selection can judge)."""

    name: str
    tags: frozenset[str]
    capabilities: frozenset[str]
    gpu: int = 0

    @classmethod
    def of(cls, pool: AgentPool) -> PoolLabels:
        return cls(
            pool.name, frozenset(pool.agent_tags()), frozenset(pool.capabilities or []), pool.gpu
        )


def labels_satisfy(selectors: Selectors, labels: PoolLabels) -> bool:
    """Whether an agent started with ``labels`` meets the task's static selectors."""
    if selectors.agent:
        return False
    if not set(selectors.tags) <= labels.tags:
        return False
    if selectors.capability and selectors.capability not in labels.capabilities:
        return False
    if isinstance(selectors.gpu, str):
        return False
    return not selectors.wants_gpu or labels.gpu > 0


def first_pool_for(selectors: Selectors, pools: Sequence[PoolLabels]) -> str | None:
    """The name of the first pool (in the order given) whose labels satisfy the selectors."""
    for labels in pools:
        if labels_satisfy(selectors, labels):
            return labels.name
    return None


def pool_of_tags(tags: Iterable[str] | None) -> str:
    """The pool an agent belongs to: its ``pool:<name>`` tag, else the default pool."""
    for tag in tags or ():
        if isinstance(tag, str) and tag.startswith(POOL_TAG_PREFIX) and len(tag) > 5:
            return tag[len(POOL_TAG_PREFIX) :]
    return DEFAULT_POOL


def tenant_pools(tenant_id: int) -> list[AgentPool]:
    """The tenant's pools, default first (an unsaved, unlabelled one if its row is missing),
    then the named pools in creation order."""
    return tenant_pools_from(
        tenant_id, AgentPool.objects.filter(tenant_id=tenant_id).order_by("id")
    )


def tenant_pools_from(tenant_id: int, pools: Iterable[AgentPool]) -> list[AgentPool]:
    """``pools`` (one tenant's rows, by creation) in pool order: default first."""
    pools = list(pools)
    default = next((p for p in pools if p.is_default), None) or AgentPool(
        tenant_id=tenant_id, name=DEFAULT_POOL
    )
    return [default, *(p for p in pools if not p.is_default)]


def live_members(tenant_id: int) -> Counter[str]:
    """Live agents of the tenant per pool name."""
    since = timezone.now() - timedelta(seconds=get_config().liveness_window_s)
    tags = Agent.objects.filter(
        tenant_id=tenant_id, state=AgentState.LIVE, last_heartbeat__gt=since
    ).values_list("tags", flat=True)
    return Counter(pool_of_tags(t) for t in tags)


def scalable_pool_reason(tenant_id: int, selectors: Selectors) -> str | None:
    """Why a task no live agent matches should wait: a pool that could run it has agents
    asked for that are not live yet, or can grow (an actuator runs the fleet and the
    tenant's pools hold less than its effective limit).  None when no such pool exists:
    the task cannot run (NoMatchingAgent)."""
    if selectors.agent:
        return None
    pools = [p for p in tenant_pools(tenant_id) if labels_satisfy(selectors, PoolLabels.of(p))]
    if not pools:
        return None
    tenant = Tenant.objects.filter(pk=tenant_id).first()
    if tenant is None or not tenant.is_active:
        return None
    config = get_config()
    limit = tenant.effective_limit(config.default_max_agents)
    # Without an actuator nothing starts an agent when a count rises: only agents asked
    # for (a pool's count above its live members: an operator runs them) are worth a wait.
    can_grow = config.fleet_actuator != NO_ACTUATOR and tenant.desired_count < limit
    named = AgentPool.objects.filter(tenant_id=tenant_id).aggregate(n=Sum("desired_count"))["n"]
    live = live_members(tenant_id)
    wanted = selectors.static_text() or "untargeted work"
    for pool in pools:
        desired = (
            max(tenant.desired_count - (named or 0), 0) if pool.is_default else pool.desired_count
        )
        if desired > live[pool.name]:
            return (
                f"NoFreeAgent: no live agent matches {wanted}; pool {pool.name!r} can run it "
                f"and {desired - live[pool.name]} of its {desired} agent(s) are not live yet"
            )
        if can_grow:
            return (
                f"NoFreeAgent: no live agent matches {wanted}; pool {pool.name!r} can run it "
                f"and can be scaled up (desired {desired}; the tenant's pools hold "
                f"{tenant.desired_count} of its limit {limit}): provision it or let the "
                "autoscaler"
            )
    return None
