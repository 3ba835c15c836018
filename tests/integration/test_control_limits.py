"""Limits and desired_count: the rules, the audit trail, and that concurrent changes lose nothing."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from fleet.api.error_status import http_status
from fleet.control import limits
from fleet.control.actuators.base import ReconcileResult
from fleet.control.actuators.noop import NoopActuator
from fleet.control.reconciler import reconcile_all
from fleet.models import ChangeReason, FleetChange, Tenant
from fleet.platform.config import Config, get_config, load_config, reset_config


def changes(tenant, field="desired_count"):
    return list(
        FleetChange.objects.filter(tenant=tenant, field=field)
        .order_by("id")
        .values_list("old_value", "new_value", "reason", "actor")
    )


def test_it_provisions_up_to_the_default_limit_then_refuses(tenant):
    assert limits.effective_limit(tenant) == 4  # CLOACINA_DEFAULT_MAX_AGENTS default
    for expected in (1, 2, 3, 4):
        assert limits.provision(tenant, "alice") == expected
    with pytest.raises(limits.FleetLimitError) as err:
        limits.provision(tenant, "alice")
    assert http_status(err.value) == 409
    assert "effective limit (4)" in err.value.detail
    tenant.refresh_from_db()
    assert tenant.desired_count == 4
    assert changes(tenant) == [(n, n + 1, ChangeReason.MANUAL, "alice") for n in range(4)]


def test_it_deprovisions_to_zero_then_refuses(tenant):
    limits.provision(tenant, "a")
    assert limits.deprovision(tenant, "b") == 0
    with pytest.raises(limits.FleetLimitError) as err:
        limits.deprovision(tenant, "b")
    assert http_status(err.value) == 409
    assert "already 0" in err.value.detail
    assert changes(tenant)[-1] == (1, 0, ChangeReason.MANUAL, "b")


def test_it_refuses_a_disabled_tenant(tenant):
    Tenant.objects.filter(pk=tenant.pk).update(is_active=False)
    with pytest.raises(limits.FleetLimitError) as err:
        limits.provision(tenant, "a")
    assert http_status(err.value) == 409 and "disabled" in err.value.detail


def test_an_override_replaces_the_default_limit(tenant):
    limits.set_fleet_overrides(tenant, "root", max_agents_override=6)
    assert limits.effective_limit(tenant) == 6
    for _ in range(6):
        limits.provision(tenant, "a")
    with pytest.raises(limits.FleetLimitError):
        limits.provision(tenant, "a")
    assert changes(tenant, "max_agents_override") == [(None, 6, ChangeReason.ADMIN, "root")]


def test_lowering_the_limit_below_desired_count_clamps_it(tenant):
    for _ in range(4):
        limits.provision(tenant, "a")
    updated = limits.set_fleet_overrides(tenant, "root", max_agents_override=2)
    assert updated.desired_count == 2
    tenant.refresh_from_db()
    assert (tenant.desired_count, tenant.max_agents_override) == (2, 2)
    assert changes(tenant)[-1] == (4, 2, ChangeReason.CLAMP, "root")
    assert changes(tenant, "max_agents_override") == [(None, 2, ChangeReason.ADMIN, "root")]


def test_clearing_the_override_returns_to_the_default(tenant):
    limits.set_fleet_overrides(tenant, "root", max_agents_override=1)
    limits.set_fleet_overrides(tenant, "root", max_agents_override=None)
    tenant.refresh_from_db()
    assert tenant.max_agents_override is None
    assert limits.effective_limit(tenant) == 4


def test_an_admin_desired_count_above_the_limit_changes_nothing(tenant):
    with pytest.raises(limits.FleetLimitError) as err:
        limits.set_fleet_overrides(tenant, "root", max_agents_override=3, desired_count=5)
    assert http_status(err.value) == 422 and "exceeds the effective limit (3)" in err.value.detail
    tenant.refresh_from_db()
    assert (tenant.max_agents_override, tenant.desired_count) == (None, 0)
    assert not FleetChange.objects.filter(tenant=tenant).exists()


def test_an_admin_sets_both_in_one_change(tenant):
    limits.set_fleet_overrides(tenant, "root", max_agents_override=8, desired_count=7)
    tenant.refresh_from_db()
    assert (tenant.max_agents_override, tenant.desired_count) == (8, 7)
    assert changes(tenant) == [(0, 7, ChangeReason.ADMIN, "root")]


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_it_rejects_malformed_numbers(tenant, bad):
    with pytest.raises(limits.FleetLimitError) as err:
        limits.set_fleet_overrides(tenant, "root", max_agents_override=bad)
    assert http_status(err.value) == 422


def test_the_snapshot_counts_agents_backlog_and_outbox(tenant, other_tenant):
    from agents.models import Agent

    Agent.objects.create(
        tenant=tenant, name="a1", target_triple="t", max_concurrency=4, in_flight=3
    )
    Agent.objects.create(
        tenant=tenant, name="a2", target_triple="t", max_concurrency=4, in_flight=1
    )
    Agent.objects.create(tenant=tenant, name="a3", target_triple="t", state="draining", in_flight=1)
    Agent.objects.create(tenant=tenant, name="a4", target_triple="t", state="dead")
    Agent.objects.create(tenant=other_tenant, name="x", target_triple="t", max_concurrency=9)
    snap = limits.fleet_snapshot(tenant)
    assert snap["utilization"] == pytest.approx(0.5)
    assert (snap["agents_live"], snap["agents_draining"], snap["agents_total"]) == (2, 1, 3)
    assert (snap["in_flight"], snap["capacity"], snap["backlog"], snap["outbox_open"]) == (
        4,
        8,
        0,
        0,
    )
    assert snap["effective_limit"] == 4 and snap["overridden"] is False


@pytest.mark.django_db(transaction=True)
def test_concurrent_provision_calls_never_lose_an_update():
    tenant = Tenant.objects.create(name="race", max_agents_override=40)
    barrier = threading.Barrier(10)
    results: list[int | str] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        barrier.wait()
        try:
            for _ in range(6):  # 60 attempts against a limit of 40
                try:
                    value: int | str = limits.provision(tenant, f"thread-{n}")
                except limits.FleetLimitError as exc:
                    value = f"{http_status(exc)}"
                with lock:
                    results.append(value)
        finally:
            connection.close()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tenant.refresh_from_db()
    granted = sorted(r for r in results if isinstance(r, int))
    assert granted == list(range(1, 41))  # every value handed out exactly once
    assert results.count("409") == 20
    assert tenant.desired_count == 40
    assert FleetChange.objects.filter(tenant=tenant, reason=ChangeReason.MANUAL).count() == 40


# -- a limit lowered by anything but an override: clamped once, audited, never acted on ------
@pytest.fixture
def lowered_default(monkeypatch):
    """Restart with a smaller CLOACINA_DEFAULT_MAX_AGENTS: the configuration is re-read."""

    def lower(value: int) -> Config:
        monkeypatch.setenv("CLOACINA_DEFAULT_MAX_AGENTS", str(value))
        reset_config()
        return get_config()

    yield lower
    monkeypatch.undo()
    reset_config()


def clamps(tenant):
    return list(
        FleetChange.objects.filter(tenant=tenant, reason=ChangeReason.CLAMP)
        .order_by("id")
        .values_list("old_value", "new_value", "actor", "note")
    )


def test_a_lowered_platform_default_clamps_desired_count_once(
    tenant, other_tenant, lowered_default
):
    for _ in range(4):
        limits.provision(tenant, "a")
    limits.provision(other_tenant, "a")
    lowered_default(2)
    assert limits.effective_limit(tenant) == 2
    [change] = limits.clamp_to_limits()
    tenant.refresh_from_db()
    assert tenant.desired_count == 2
    why = "platform default max agents (CLOACINA_DEFAULT_MAX_AGENTS) lowered to 2"
    assert clamps(tenant) == [(4, 2, limits.SYSTEM_ACTOR, why)]
    assert change.tenant_id == tenant.pk
    # Within its limit already: untouched and not audited; and a second pass changes nothing.
    assert Tenant.objects.get(pk=other_tenant.pk).desired_count == 1
    assert limits.clamp_to_limits() == []
    assert clamps(tenant) == [(4, 2, limits.SYSTEM_ACTOR, why)] and clamps(other_tenant) == []


def test_an_override_lowered_behind_the_controls_back_is_clamped_too(tenant):
    Tenant.objects.filter(pk=tenant.pk).update(desired_count=4, max_agents_override=1)
    limits.clamp_to_limits(default_max=4)
    assert Tenant.objects.get(pk=tenant.pk).desired_count == 1
    assert clamps(tenant) == [(4, 1, limits.SYSTEM_ACTOR, "max_agents_override lowered to 1")]


def test_an_admin_clamp_says_why_as_well(tenant):
    for _ in range(3):
        limits.provision(tenant, "a")
    limits.set_fleet_overrides(tenant, "root", max_agents_override=1)
    assert clamps(tenant) == [(3, 1, "root", "max_agents_override lowered to 1")]


def test_the_autoscaler_tick_clamps_and_does_not_audit_twice(tenant, lowered_default):
    from fleet.control.autoscaler import HOLD, autoscale_tick

    Tenant.objects.filter(pk=tenant.pk).update(desired_count=4)
    config = lowered_default(2)
    [row] = autoscale_tick(config, timezone.now())
    assert (row.old_desired, row.new_desired, row.decision) == (2, 2, HOLD)
    assert Tenant.objects.get(pk=tenant.pk).desired_count == 2
    autoscale_tick(config, timezone.now() + timedelta(seconds=1))
    assert [(old, new) for old, new, _, _ in clamps(tenant)] == [(4, 2)]


class RecordingActuator(NoopActuator):
    """Remembers every desired count it was asked to reach."""

    def __init__(self) -> None:
        self.asked: dict[str, list[int]] = {}

    def reconcile(self, tenant: Tenant, desired) -> ReconcileResult:
        result = super().reconcile(tenant, desired)
        self.asked.setdefault(tenant.name, []).append(result.desired)  # all pools together
        return result


def test_the_reconciler_never_asks_for_more_than_the_limit(tenant, other_tenant, lowered_default):
    Tenant.objects.filter(pk=tenant.pk).update(desired_count=4)
    Tenant.objects.filter(pk=other_tenant.pk).update(desired_count=3, max_agents_override=5)
    lowered_default(2)
    actuator = RecordingActuator()
    reconcile_all(actuator)  # autoscaling off: the reconciler alone still clamps
    reconcile_all(actuator)
    assert actuator.asked == {tenant.name: [2, 2], other_tenant.name: [3, 3]}
    assert Tenant.objects.get(pk=tenant.pk).desired_count == 2
    assert len(clamps(tenant)) == 1 and clamps(other_tenant) == []


def test_the_control_tick_with_autoscaling_off_clamps_before_it_reconciles(tenant, tmp_path):
    from fleet.control.jobs import control_tick
    from fleet.control.leadership import StickyLeadership
    from fleet.platform.advisory_locks import lock_id_for

    Tenant.objects.filter(pk=tenant.pk).update(desired_count=4)
    config = load_config(
        {
            "CLOACINA_HOME": str(tmp_path),
            "CLOACINA_AUTOSCALE": "false",
            "CLOACINA_DEFAULT_MAX_AGENTS": "3",
        }
    )
    actuator = RecordingActuator()
    leadership = StickyLeadership(lock_id_for("test_control_limits"))
    try:
        report = control_tick(actuator, config, leadership)
    finally:
        leadership.release()
    assert report is not None and report.decisions == []
    assert actuator.asked == {tenant.name: [3]}
    why = "platform default max agents (CLOACINA_DEFAULT_MAX_AGENTS) lowered to 3"
    assert clamps(tenant) == [(4, 3, limits.SYSTEM_ACTOR, why)]
