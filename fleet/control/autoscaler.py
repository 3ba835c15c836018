"""The back-pressure autoscaler: a pure decision per agent pool, and the tick that applies it.

Signal per pool of every tenant (:mod:`fleet.models.pools`; a tenant without named pools
has one, ``default``, and behaves exactly as before pools): utilization = Σ in_flight /
Σ max_concurrency over the pool's live agents, plus its backlog: the due Ready tasks
the pool's agents could run (a task counts toward the first pool whose labels satisfy
its routing keys, :mod:`fleet.executors.fleet.routing.pool_match`; default first), so
the autoscaler never adds CPU agents for work only a GPU pool can take.  The pool's
"effective limit" is its share: its count plus what the tenant's pools leave free.  The backlog
is what lets a tenant with no agents at all, or with agents that are all busy,
scale up: utilization alone is undefined at zero agents, so a tenant scaled
to zero would never come back although work is waiting.

Rules (:func:`decide`, which takes ``now`` so tests control time):

* up (+1) when utilization > the up threshold, or the backlog exceeds the
  live agents' spare slots, and desired_count < the effective limit;
* down (−1) when utilization < the down threshold with no backlog, and
  desired_count > CLOACINA_AUTOSCALE_FLOOR (the floor binds the autoscaler only, and
  only the default pool: a named pool may scale down to 0);
* hold otherwise; and hold while the tenant is within its cooldown of the
  last desired_count change (by anyone), or while agents it already asked for
  have not come up (so a slow start never runs the count up to the limit).
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Count, Max, Q
from django.utils import timezone

from agents.models import Agent, AgentState
from fleet.control import pools
from fleet.control.limits import clamp_to_limits, pool_field
from fleet.executors.fleet.routing import pool_match
from fleet.executors.fleet.routing.selectors import SelectorError, Selectors
from fleet.models import (
    DEFAULT_POOL,
    AgentPool,
    AutoscaleDecision,
    ChangeReason,
    FleetChange,
    TaskExecution,
    TaskStatus,
    Tenant,
)
from fleet.platform.config import Config

log = logging.getLogger(__name__)

UP, DOWN, HOLD = "up", "down", "hold"
ACTOR = "autoscaler"
HOLD_RETENTION = timedelta(days=1)  # "hold" rows are only interesting recently; changes are kept


@dataclass(frozen=True)
class Policy:
    up_threshold: float = 0.8
    down_threshold: float = 0.2
    floor: int = 0
    cooldown_s: float = 60.0

    @classmethod
    def from_config(cls, config: Config) -> Policy:
        return cls(
            config.autoscale_up_threshold,
            config.autoscale_down_threshold,
            config.autoscale_floor,
            config.autoscale_cooldown_s,
        )


@dataclass(frozen=True)
class Signal:
    """What the autoscaler knows about one tenant at one instant."""

    tenant_id: int
    desired: int
    limit: int
    live_agents: int = 0
    in_flight: int = 0
    capacity: int = 0  # Σ max_concurrency of live agents
    backlog: int = 0
    last_change_at: datetime | None = None
    pool: str = DEFAULT_POOL

    @property
    def utilization(self) -> float | None:
        return self.in_flight / self.capacity if self.capacity else None


@dataclass(frozen=True)
class Decision:
    action: str  # up | down | hold
    new_desired: int
    reason: str


def _util(signal: Signal) -> str:
    u = signal.utilization
    return "n/a (no live agents)" if u is None else f"{u:.2f}"


def decide(signal: Signal, policy: Policy, now: datetime) -> Decision:
    """The autoscaler's decision for one tenant (pure: no I/O, no clock)."""
    desired, util = signal.desired, signal.utilization
    spare = max(signal.capacity - signal.in_flight, 0)
    hot = util is not None and util > policy.up_threshold
    starved = signal.backlog > spare
    cold = util is not None and util < policy.down_threshold and signal.backlog == 0
    if hot or starved:
        why = (
            f"utilization {_util(signal)} > {policy.up_threshold:g}"
            if hot
            else f"backlog {signal.backlog} > {spare} free slot(s)"
        )
        if desired >= signal.limit:
            return Decision(HOLD, desired, f"{why}, but at the effective limit ({signal.limit})")
        if signal.live_agents < desired:
            return Decision(
                HOLD,
                desired,
                f"{why}, but {desired - signal.live_agents} requested agent(s) not live yet",
            )
        left = _cooldown_left(signal, policy, now)
        if left > 0:
            return Decision(HOLD, desired, f"{why}, but cooling down ({left:.0f}s left)")
        return Decision(UP, desired + 1, why)
    if cold:
        why = f"utilization {_util(signal)} < {policy.down_threshold:g} and no backlog"
        if desired <= policy.floor:
            return Decision(HOLD, desired, f"{why}, but at the floor ({policy.floor})")
        left = _cooldown_left(signal, policy, now)
        if left > 0:
            return Decision(HOLD, desired, f"{why}, but cooling down ({left:.0f}s left)")
        return Decision(DOWN, desired - 1, why)
    if util is None:
        return Decision(HOLD, desired, "no live agents and no backlog")
    return Decision(
        HOLD,
        desired,
        f"utilization {_util(signal)} within [{policy.down_threshold:g}, {policy.up_threshold:g}]",
    )


def _cooldown_left(signal: Signal, policy: Policy, now: datetime) -> float:
    if signal.last_change_at is None:
        return 0.0
    return policy.cooldown_s - (now - signal.last_change_at).total_seconds()


# -- gathering the signal ------------------------------------------------------------
def _due_backlog(now: datetime) -> dict[int, list[tuple[dict | None, int]]]:
    """Due Ready tasks per tenant, grouped by their routing keys: (routing, count) pairs."""
    rows = (
        TaskExecution.objects.filter(status=TaskStatus.READY)
        .filter(Q(ready_at__isnull=True) | Q(ready_at__lte=now))
        .values("tenant_id", "routing")
        .annotate(n=Count("id"))
        .values_list("tenant_id", "routing", "n")
    )
    grouped: dict[int, list[tuple[dict | None, int]]] = defaultdict(list)
    for tenant_id, routing, n in rows:
        grouped[tenant_id].append((routing, n))
    return grouped


def _backlog_per_pool(
    backlog: list[tuple[dict | None, int]], labels: list[pool_match.PoolLabels]
) -> Counter[str]:
    """Each task counts toward the first pool that could run it (default first, then by
    creation); a task no pool could run, or with unusable routing keys, toward none."""
    counts: Counter[str] = Counter()
    for routing, n in backlog:
        try:
            selectors = Selectors.from_routing(routing)
        except SelectorError:
            continue  # it fails at placement; no agent would help
        pool = pool_match.first_pool_for(selectors, labels)
        if pool is not None:
            counts[pool] += n
    return counts


def _live_per_pool() -> dict[tuple[int, str], list[int]]:
    """(tenant, pool) → [live agents, Σ in_flight, Σ max_concurrency]."""
    found: dict[tuple[int, str], list[int]] = {}
    rows = Agent.objects.filter(state=AgentState.LIVE).values_list(
        "tenant_id", "tags", "in_flight", "max_concurrency"
    )
    for tenant_id, tags, in_flight, slots in rows:
        row = found.setdefault((tenant_id, pool_match.pool_of_tags(tags)), [0, 0, 0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + in_flight, row[2] + slots
    return found


def _last_changes() -> dict[tuple[int, str], datetime]:
    """(tenant, audit field) → when it last changed: a pool's cooldown clock."""
    rows = (
        FleetChange.objects.filter(Q(field="desired_count") | Q(field__startswith="pool:"))
        .values("tenant_id", "field")
        .annotate(at=Max("at"))
        .values_list("tenant_id", "field", "at")
    )
    return {(tenant_id, field): at for tenant_id, field, at in rows}


def gather_signals(config: Config, now: datetime) -> list[Signal]:
    """One Signal per pool of every active tenant (default first), from four queries.

    A pool's ``limit`` is its share of the tenant's effective limit: its own count plus
    whatever the tenant's pools together leave free.  Its cooldown counts from its own last
    change (the default pool's: from the tenant's, whichever pool moved it).
    """
    agents = _live_per_pool()
    backlog = _due_backlog(now)
    changes = _last_changes()
    pools_of: dict[int, list[AgentPool]] = defaultdict(list)
    for pool in AgentPool.objects.filter(tenant__is_active=True).order_by("id"):
        pools_of[pool.tenant_id].append(pool)
    signals = []
    for t in Tenant.objects.filter(is_active=True):
        pools = pool_match.tenant_pools_from(t.pk, pools_of[t.pk])
        labels = [pool_match.PoolLabels.of(p) for p in pools]
        waiting = _backlog_per_pool(backlog.get(t.pk, []), labels)
        named = sum(p.desired_count for p in pools if not p.is_default)
        free = max(t.effective_limit(config.default_max_agents) - t.desired_count, 0)
        for pool in pools:
            desired = max(t.desired_count - named, 0) if pool.is_default else pool.desired_count
            live, in_flight, capacity = agents.get((t.pk, pool.name), (0, 0, 0))
            field = "desired_count" if pool.is_default else pool_field(pool.name)
            last = changes.get((t.pk, field))
            if pool.is_default:
                last = max(filter(None, (last, t.last_autoscaled_at)), default=None)
            signals.append(
                Signal(
                    tenant_id=t.pk,
                    desired=desired,
                    limit=desired + free,
                    live_agents=live,
                    in_flight=in_flight,
                    capacity=capacity,
                    backlog=waiting[pool.name],
                    last_change_at=last,
                    pool=pool.name,
                )
            )
    return signals


# -- applying ------------------------------------------------------------------------
def apply_decision(
    signal: Signal, decision: Decision, now: datetime, default_max: int | None = None
) -> AutoscaleDecision:
    """Apply ``decision`` to its pool (compare-and-set on the count the signal saw, the
    tenant total re-checked against the limit) and record it (and the change)."""
    with transaction.atomic():
        if decision.action != HOLD:
            tenant = Tenant.objects.get(pk=signal.tenant_id)
            try:
                pools.step_pool(
                    tenant,
                    signal.pool,
                    decision.new_desired - signal.desired,
                    ACTOR,
                    ChangeReason.AUTOSCALER,
                    expect=signal.desired,
                )
                Tenant.objects.filter(pk=signal.tenant_id).update(last_autoscaled_at=now)
            except pools.FleetLimitError as refused:
                decision = Decision(
                    HOLD,
                    signal.desired,
                    f"{decision.reason}; not applied: desired_count or limit changed "
                    f"meanwhile ({refused.detail})",
                )
        return AutoscaleDecision.objects.create(
            tenant_id=signal.tenant_id,
            pool=signal.pool,
            at=now,
            utilization=signal.utilization,
            backlog=signal.backlog,
            decision=decision.action,
            old_desired=signal.desired,
            new_desired=decision.new_desired,
            reason=decision.reason[:300],
        )


def autoscale_tick(config: Config, now: datetime | None = None) -> list[AutoscaleDecision]:
    """Decide and apply for every active tenant; return the recorded decisions."""
    now = now or timezone.now()
    policy = Policy.from_config(config)
    # A limit lowered since the last tick (e.g. by config) first pulls desired_count down,
    # so every decision below starts from a count within the limit.
    clamp_to_limits(config.default_max_agents, now)
    recorded = []
    named_policy = replace(policy, floor=0)
    for signal in gather_signals(config, now):
        decision = decide(signal, policy if signal.pool == DEFAULT_POOL else named_policy, now)
        row = apply_decision(signal, decision, now)
        if row.decision != HOLD:
            log.info(
                "autoscaler: tenant %s pool %s desired_count %d → %d (%s)",
                signal.tenant_id,
                signal.pool,
                row.old_desired,
                row.new_desired,
                row.reason,
            )
        recorded.append(row)
    AutoscaleDecision.objects.filter(decision=HOLD, at__lt=now - HOLD_RETENTION).delete()
    return recorded
