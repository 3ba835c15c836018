"""The control tick: sticky leadership, CLOACINA_AUTOSCALE=false freezing scaling while
reconciliation goes on, and a lost leadership giving the fleet up."""

from __future__ import annotations

import docker
import pytest

from fleet.control.actuators.docker import DockerActuator
from fleet.control.actuators.naming import tenant_label
from fleet.control.actuators.settings import ControlSettings
from fleet.control.jobs import control_tick
from fleet.control.leadership import StickyLeadership
from fleet.models import AutoscaleDecision, Tenant
from fleet.platform.advisory_locks import lock_id_for
from fleet.platform.config import load_config
from tests.support.factories import make_ready_tasks
from tests.support.fakes.docker_engine import FakeDockerEngine

LOCK = lock_id_for("test_control_jobs")


@pytest.fixture
def leaders(db):
    made: list[StickyLeadership] = []

    def make() -> StickyLeadership:
        made.append(StickyLeadership(LOCK))
        return made[-1]

    yield make
    for leadership in made:
        leadership.release()


def test_leadership_is_kept_across_ticks_until_released(leaders):
    first, second = leaders(), leaders()
    assert first.hold() and first.hold() and first.hold()
    assert not second.hold()
    first.release()
    assert second.hold()
    assert not first.hold()


def test_a_dead_session_loses_the_leadership(leaders):
    first, second = leaders(), leaders()
    assert first.hold()
    first._conn.close()  # the connection dies: PostgreSQL drops the session's locks
    assert second.hold()
    assert not first.hold() and not first.held


@pytest.fixture
def engine():
    with FakeDockerEngine() as fake:
        yield fake


@pytest.fixture
def actuator(engine):
    return DockerActuator(
        ControlSettings(server_url="http://s:8000"),
        client_factory=lambda: docker.DockerClient(base_url=engine.base_url),
    )


def config(tmp_path, **env):
    return load_config({"CLOACINA_HOME": str(tmp_path), **env})


def test_autoscale_false_freezes_scaling_but_reconcile_runs(
    tmp_path, tenant, leaders, engine, actuator
):
    Tenant.objects.filter(pk=tenant.pk).update(desired_count=2)
    make_ready_tasks(tenant, 5)  # pressure that would scale up if scaling were on
    report = control_tick(actuator, config(tmp_path, CLOACINA_AUTOSCALE="false"), leaders())
    assert report.decisions == [] and not AutoscaleDecision.objects.exists()
    assert Tenant.objects.get(pk=tenant.pk).desired_count == 2
    assert len(engine.by_label(cloacina_tenant=tenant_label("acme"))) == 2  # reconciled


def test_autoscale_true_scales_then_reconciles_in_one_tick(
    tmp_path, tenant, leaders, engine, actuator
):
    make_ready_tasks(tenant, 1)
    report = control_tick(actuator, config(tmp_path), leaders())
    assert [d.decision for d in report.decisions] == ["up"]
    assert len(engine.by_label(cloacina_tenant=tenant_label("acme"))) == 1


def test_a_follower_does_nothing_and_a_deposed_leader_gives_the_fleet_up(
    tmp_path, tenant, leaders, engine, actuator
):
    Tenant.objects.filter(pk=tenant.pk).update(desired_count=1)
    mine, theirs = leaders(), leaders()
    assert theirs.hold()
    assert control_tick(actuator, config(tmp_path), mine) is None  # a follower
    assert engine.containers == {}
    theirs.release()
    assert control_tick(actuator, config(tmp_path), mine) is not None
    [box] = engine.containers.values()
    mine._conn.close()  # leadership lost (its session died) while another takes over
    assert theirs.hold()
    assert control_tick(actuator, config(tmp_path), mine) is None
    # the docker actuator keeps nothing local, so a deposed leader leaves the containers be
    assert box.signals == []
