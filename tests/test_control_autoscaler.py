"""The autoscaler: the decision table (time passed in, never slept) and the tick on a real DB."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from cloacina_site.config import load_config
from fleet.control import limits
from fleet.control.autoscaler import DOWN, HOLD, UP, Policy, Signal, autoscale_tick, decide
from fleet.models import AutoscaleDecision, ChangeReason, FleetChange, Tenant
from tests.factories import make_package, start

NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
POLICY = Policy(up_threshold=0.8, down_threshold=0.2, floor=1, cooldown_s=60)


def sig(desired=2, limit=4, live=None, in_flight=0, capacity=None, backlog=0, last=None):
    live = desired if live is None else live
    capacity = live * 4 if capacity is None else capacity
    return Signal(1, desired, limit, live, in_flight, capacity, backlog, last)


# (signal, expected action, expected new desired_count, words in the reason)
TABLE = [
    # utilization above the up threshold, room under the limit → +1
    (sig(desired=2, in_flight=7), UP, 3, "utilization 0.88 > 0.8"),
    (sig(desired=2, in_flight=0, capacity=10), DOWN, 1, "utilization 0.00 < 0.2"),
    # exactly at either threshold is not beyond it → hold in the band
    (sig(desired=2, in_flight=8, capacity=10), HOLD, 2, "within [0.2, 0.8]"),
    (sig(desired=2, in_flight=5, capacity=10), HOLD, 2, "within"),
    (sig(desired=2, in_flight=2, capacity=10), HOLD, 2, "within"),
    # at the effective limit: hold however hot
    (sig(desired=4, limit=4, in_flight=16), HOLD, 4, "at the effective limit (4)"),
    # cold, but at the floor (1): hold; the floor binds only the autoscaler
    (sig(desired=1, in_flight=0), HOLD, 1, "at the floor (1)"),
    # cold above the floor → −1
    (sig(desired=3, in_flight=1, capacity=12), DOWN, 2, "< 0.2 and no backlog"),
    # cold utilization but work is waiting: not a reason to shrink
    (sig(desired=3, in_flight=1, capacity=12, backlog=1), HOLD, 3, "within"),
    # zero agents, queued work → scale up from zero
    (sig(desired=0, live=0, capacity=0, backlog=3), UP, 1, "backlog 3 > 0 free slot(s)"),
    # zero agents, nothing waiting → hold (nothing to measure)
    (sig(desired=0, live=0, capacity=0), HOLD, 0, "no live agents and no backlog"),
    # busy agents with a backlog bigger than the spare slots → +1
    (sig(desired=1, in_flight=3, capacity=4, backlog=2), UP, 2, "backlog 2 > 1 free slot(s)"),
    # requested agents not up yet: do not run the count up to the limit
    (sig(desired=2, live=1, in_flight=4, capacity=4), HOLD, 2, "1 requested agent(s) not live yet"),
    # cooldown holds both directions…
    (
        sig(desired=2, in_flight=8, last=NOW - timedelta(seconds=30)),
        HOLD,
        2,
        "cooling down (30s left)",
    ),
    (
        sig(desired=3, in_flight=0, last=NOW - timedelta(seconds=59)),
        HOLD,
        3,
        "cooling down (1s left)",
    ),
    # …and releases them once it has passed
    (sig(desired=2, in_flight=8, last=NOW - timedelta(seconds=60)), UP, 3, "utilization 1.00"),
    (sig(desired=3, in_flight=0, last=NOW - timedelta(seconds=61)), DOWN, 2, "< 0.2"),
]


@pytest.mark.parametrize(("signal", "action", "new", "words"), TABLE)
def test_the_decision_table(signal, action, new, words):
    decision = decide(signal, POLICY, NOW)
    assert (decision.action, decision.new_desired) == (action, new), decision.reason
    assert words in decision.reason


def test_a_zero_floor_lets_it_scale_to_zero():
    decision = decide(sig(desired=1, in_flight=0), Policy(floor=0), NOW)
    assert (decision.action, decision.new_desired) == (DOWN, 0)


# -- the tick, on the database ---------------------------------------------------------
def config(**env):
    base = {"CLOACINA_HOME": "/tmp/cloacina-autoscaler-test", "CLOACINA_AUTOSCALE_COOLDOWN_S": "60"}
    return load_config({**base, **{k: str(v) for k, v in env.items()}})


def make_agents(tenant, n, max_concurrency=2, in_flight=0):
    from agents.models import Agent

    for i in range(n):
        Agent.objects.create(
            tenant=tenant,
            name=f"{tenant.name}-{i}",
            target_triple="x86_64-unknown-linux-gnu",
            max_concurrency=max_concurrency,
            in_flight=in_flight,
        )


def make_ready_tasks(tenant, n):
    """Start an execution of a workflow with ``n`` independent tasks: all ``n`` are Ready."""
    tasks = [{"id": f"t{i}", "function": "demo.steps:noop"} for i in range(n)]
    make_package(tenant, tasks, "def noop(ctx):\n    return None\n")
    execution, by_id = start(tenant, "demo")
    assert [t.status for t in by_id.values()] == ["Ready"] * n


def test_a_busy_tenant_scales_up_and_the_change_is_audited(tenant):
    Tenant.objects.filter(pk=tenant.pk).update(desired_count=2)
    make_agents(tenant, 2, max_concurrency=2, in_flight=2)
    [row] = autoscale_tick(config(), timezone.now())
    tenant.refresh_from_db()
    assert tenant.desired_count == 3
    assert (row.decision, row.old_desired, row.new_desired, row.utilization) == (UP, 2, 3, 1.0)
    change = FleetChange.objects.get(tenant=tenant)
    assert (change.old_value, change.new_value, change.reason, change.actor) == (
        2,
        3,
        ChangeReason.AUTOSCALER,
        "autoscaler",
    )
    assert tenant.last_autoscaled_at is not None


def test_a_tenant_at_zero_with_queued_work_scales_up(tenant):
    make_ready_tasks(tenant, 3)
    [row] = autoscale_tick(config(), timezone.now())
    assert (row.decision, row.backlog, row.utilization) == (UP, 3, None)
    tenant.refresh_from_db()
    assert tenant.desired_count == 1


def test_cooldown_counts_manual_changes_too(tenant):
    limits.provision(tenant, "alice")
    limits.provision(tenant, "alice")
    make_agents(tenant, 2, in_flight=0)
    now = timezone.now()
    [row] = autoscale_tick(config(CLOACINA_AUTOSCALE_FLOOR=0), now)
    assert row.decision == HOLD and "cooling down" in row.reason
    [row] = autoscale_tick(config(CLOACINA_AUTOSCALE_FLOOR=0), now + timedelta(seconds=61))
    assert (row.decision, row.new_desired) == (DOWN, 1)


def test_it_respects_the_floor_and_the_limit(tenant, other_tenant):
    Tenant.objects.filter(pk=tenant.pk).update(desired_count=2)
    Tenant.objects.filter(pk=other_tenant.pk).update(desired_count=2, max_agents_override=2)
    make_agents(tenant, 2, in_flight=0)
    make_agents(other_tenant, 2, in_flight=2)
    rows = {r.tenant_id: r for r in autoscale_tick(config(CLOACINA_AUTOSCALE_FLOOR=2))}
    assert "at the floor (2)" in rows[tenant.pk].reason
    assert "at the effective limit (2)" in rows[other_tenant.pk].reason
    assert Tenant.objects.get(pk=tenant.pk).desired_count == 2
    assert Tenant.objects.get(pk=other_tenant.pk).desired_count == 2


def test_disabled_tenants_are_not_scaled(tenant):
    Tenant.objects.filter(pk=tenant.pk).update(is_active=False)
    make_ready_tasks(tenant, 5)
    assert autoscale_tick(config()) == []
    assert Tenant.objects.get(pk=tenant.pk).desired_count == 0


def test_every_tick_records_one_decision_per_tenant(tenant, other_tenant):
    now = timezone.now()
    autoscale_tick(config(), now)
    autoscale_tick(config(), now + timedelta(seconds=1))
    assert AutoscaleDecision.objects.filter(tenant=tenant).count() == 2
    assert AutoscaleDecision.objects.filter(tenant=other_tenant).count() == 2


def test_old_hold_rows_are_pruned(tenant):
    old = timezone.now() - timedelta(days=2)
    AutoscaleDecision.objects.create(tenant=tenant, at=old, decision=HOLD, old_desired=0,
                                     new_desired=0, reason="x")  # fmt: skip
    AutoscaleDecision.objects.create(tenant=tenant, at=old, decision=UP, old_desired=0,
                                     new_desired=1, reason="x")  # fmt: skip
    autoscale_tick(config())
    assert list(
        AutoscaleDecision.objects.filter(tenant=tenant, at=old).values_list("decision", flat=True)
    ) == [UP]
