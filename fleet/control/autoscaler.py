"""The back-pressure autoscaler: a pure decision per tenant, and the tick that applies it.

Signal per tenant: utilization = Σ in_flight / Σ max_concurrency over its live
agents, plus its backlog (due Ready tasks waiting for an agent).  The backlog
is what lets a tenant with no agents at all, or with agents that are all busy,
scale up: utilization alone is undefined at zero agents, so a tenant scaled
to zero would never come back although work is waiting.

Rules (:func:`decide`, which takes ``now`` so tests control time):

* up (+1) when utilization > the up threshold, or the backlog exceeds the
  live agents' spare slots, and desired_count < the effective limit;
* down (−1) when utilization < the down threshold with no backlog, and
  desired_count > CLOACINA_AUTOSCALE_FLOOR (the floor binds the autoscaler only);
* hold otherwise; and hold while the tenant is within its cooldown of the
  last desired_count change (by anyone), or while agents it already asked for
  have not come up (so a slow start never runs the count up to the limit).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import connection, transaction
from django.db.models import Count, Max, Q, Sum
from django.utils import timezone

from agents.models import Agent, AgentState
from fleet.control.limits import clamp_to_limits, record_change
from fleet.models import AutoscaleDecision, ChangeReason, TaskExecution, TaskStatus, Tenant
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
def gather_signals(config: Config, now: datetime) -> list[Signal]:
    """One Signal per active tenant, from three aggregate queries."""
    agents = {
        row["tenant_id"]: row
        for row in Agent.objects.filter(state=AgentState.LIVE)
        .values("tenant_id")
        .annotate(n=Count("id"), in_flight=Sum("in_flight"), capacity=Sum("max_concurrency"))
    }
    backlog = dict(
        TaskExecution.objects.filter(status=TaskStatus.READY)
        .filter(Q(ready_at__isnull=True) | Q(ready_at__lte=now))
        .values("tenant_id")
        .annotate(n=Count("id"))
        .values_list("tenant_id", "n")
    )
    tenants = Tenant.objects.filter(is_active=True).annotate(
        last_change=Max("fleet_changes__at", filter=Q(fleet_changes__field="desired_count"))
    )
    signals = []
    for t in tenants:
        a = agents.get(t.pk, {})
        last = max(filter(None, (t.last_change, t.last_autoscaled_at)), default=None)
        signals.append(
            Signal(
                tenant_id=t.pk,
                desired=t.desired_count,
                limit=t.effective_limit(config.default_max_agents),
                live_agents=a.get("n", 0),
                in_flight=a.get("in_flight") or 0,
                capacity=a.get("capacity") or 0,
                backlog=backlog.get(t.pk, 0),
                last_change_at=last,
            )
        )
    return signals


# -- applying ------------------------------------------------------------------------
def apply_decision(
    signal: Signal, decision: Decision, now: datetime, default_max: int
) -> AutoscaleDecision:
    """Apply ``decision`` with one compare-and-set UPDATE and record it (and the change)."""
    with transaction.atomic():
        if decision.action != HOLD:
            with connection.cursor() as cursor:
                # Bounds are re-checked here: the limit or the count may have moved since the read.
                cursor.execute(
                    """
                    UPDATE fleet_tenant SET desired_count = %s, last_autoscaled_at = %s
                    WHERE id = %s AND is_active AND desired_count = %s
                      AND %s <= COALESCE(max_agents_override, %s)
                    """,
                    [
                        decision.new_desired,
                        now,
                        signal.tenant_id,
                        signal.desired,
                        decision.new_desired,
                        default_max,
                    ],
                )
                applied = cursor.rowcount == 1
            if applied:
                record_change(
                    signal.tenant_id,
                    "desired_count",
                    signal.desired,
                    decision.new_desired,
                    ChangeReason.AUTOSCALER,
                    ACTOR,
                    now,
                )
            else:
                decision = Decision(
                    HOLD,
                    signal.desired,
                    f"{decision.reason}; not applied: desired_count or limit changed meanwhile",
                )
        return AutoscaleDecision.objects.create(
            tenant_id=signal.tenant_id,
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
    for signal in gather_signals(config, now):
        decision = decide(signal, policy, now)
        row = apply_decision(signal, decision, now, config.default_max_agents)
        if row.decision != HOLD:
            log.info(
                "autoscaler: tenant %s desired_count %d → %d (%s)",
                signal.tenant_id,
                row.old_desired,
                row.new_desired,
                row.reason,
            )
        recorded.append(row)
    AutoscaleDecision.objects.filter(decision=HOLD, at__lt=now - HOLD_RETENTION).delete()
    return recorded
