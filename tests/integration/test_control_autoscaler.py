"""The autoscaler: the decision table (time passed in, never slept) and the tick on a real DB.

Here: the integration tests (database, in-process ASGI, fakes); the rest are in tests/unit/test_control_autoscaler.py.
"""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from fleet.control import limits
from fleet.control.autoscaler import DOWN, HOLD, UP, autoscale_tick
from fleet.models import AutoscaleDecision, ChangeReason, FleetChange, Tenant
from fleet.platform.config import load_config
from tests.support.agents import make_agent
from tests.support.factories import make_ready_tasks


# -- the tick, on the database ---------------------------------------------------------
def config(**env):
    base = {"CLOACINA_HOME": "/tmp/cloacina-autoscaler-test", "CLOACINA_AUTOSCALE_COOLDOWN_S": "60"}
    return load_config({**base, **{k: str(v) for k, v in env.items()}})


def make_agents(tenant, n, max_concurrency=2, in_flight=0):
    for i in range(n):
        make_agent(
            tenant,
            f"{tenant.name}-{i}",
            triple="x86_64-unknown-linux-gnu",
            connected=False,
            max_concurrency=max_concurrency,
            in_flight=in_flight,
        )


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
