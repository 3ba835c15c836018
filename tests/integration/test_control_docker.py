"""The docker actuator against a fake Docker Engine API (the SDK's real HTTP calls)."""

from __future__ import annotations

import json

import docker
import pytest

from agents.models import Agent
from fleet.control.actuators.docker import DockerActuator
from fleet.control.actuators.naming import tenant_label
from fleet.control.actuators.settings import ControlSettings
from fleet.control.reconciler import reconcile_all
from fleet.models import ApiKey, Installation, Role, Tenant
from tests.support.clock import ManualClock
from tests.support.fakes.docker_engine import FakeDockerEngine

SERVER_URL = "http://cloacina.internal:8000"


@pytest.fixture
def engine():
    with FakeDockerEngine() as fake:
        yield fake


@pytest.fixture
def clock():
    return ManualClock(1000.0)


@pytest.fixture
def actuator(engine, clock):
    settings = ControlSettings(
        server_url=SERVER_URL, agent_image="cloacina:test", agent_max_concurrency=3,
        agent_drain_timeout_s=30,
    )  # fmt: skip
    return DockerActuator(
        settings, client_factory=lambda: docker.DockerClient(base_url=engine.base_url), clock=clock
    )


def env_of(container) -> dict:
    return dict(item.split("=", 1) for item in container.config["Env"])


def register(container, tenant) -> Agent:
    """What the agent in the container would do: register with its injected key."""
    key = ApiKey.objects.get(lookup=container.labels["cloacina.key"])
    return Agent.objects.create(tenant=tenant, api_key=key, name=container.labels["cloacina.agent"],
                                target_triple="x86_64-unknown-linux-gnu")  # fmt: skip


def test_it_starts_labelled_containers_each_with_its_own_key(engine, actuator, tenant):
    result = actuator.reconcile(tenant, 2)
    assert (result.started, result.actual) == (2, 0)
    label = tenant_label("acme")
    boxes = list(engine.containers.values())
    assert len(boxes) == 2
    tokens = set()
    for c in boxes:
        name = c.name
        assert c.labels == {
            "cloacina.managed": "true",
            "cloacina.installation": Installation.current_id(),
            "cloacina.tenant": label,
            "cloacina.agent": name,
            "cloacina.key": c.labels["cloacina.key"],
        }
        assert c.state == "running"
        assert c.config["Image"] == "cloacina:test"
        assert c.config["Cmd"] == [
            "runagent", "--server", SERVER_URL, "--name", name, "--max-concurrency", "3",
        ]  # fmt: skip
        env = env_of(c)
        assert env["CLOACINA_SERVER_URL"] == SERVER_URL
        assert env["CLOACINA_HOME"] == "/home/agent/.cloacina"  # writable tmpfs, read-only root
        assert set(c.config["HostConfig"]["Tmpfs"]) == {"/tmp", "/home/agent"}
        key = ApiKey.verify(env["CLOACINA_AGENT_API_KEY"])
        assert key is not None and key.role == Role.AGENT and key.tenant_id == tenant.pk
        assert key.lookup == c.labels["cloacina.key"]
        tokens.add(env["CLOACINA_AGENT_API_KEY"])
        host = c.config["HostConfig"]
        assert host["ReadonlyRootfs"] is True and host["CapDrop"] == ["ALL"]
        assert host["SecurityOpt"] == ["no-new-privileges:true"]
        # the default CPU/memory settings: 2 CPUs, 2Gi hard; 250m, 512Mi requested
        assert (host["NanoCpus"], host["Memory"]) == (2 * 10**9, 2 * 2**30)
        assert (host["CpuShares"], host["MemoryReservation"]) == (256, 512 * 2**20)
        assert host["NetworkMode"] == "default"  # the daemon's default unless configured
        assert c.config["User"] == "10001:10001"
        # the key travels in the environment only, never on the command line
        assert env["CLOACINA_AGENT_API_KEY"] not in json.dumps(c.config["Cmd"])
    assert len(tokens) == 2
    assert len(actuator.actual(tenant)) == 2


def test_every_list_is_filtered_by_the_tenants_label(engine, actuator, tenant, other_tenant):
    actuator.reconcile(tenant, 1)
    actuator.actual(tenant)
    actuator.stop_all(tenant)
    lists = engine.calls("GET", "/containers/json")
    assert lists
    for call in lists:
        labels = json.loads(call.q("filters"))["label"]
        assert sorted(labels) == sorted(
            ["cloacina.managed=true", f"cloacina.tenant={tenant_label('acme')}"]
        )


def test_it_never_touches_other_tenants_or_unmanaged_containers(
    engine, actuator, tenant, other_tenant
):
    actuator.reconcile(other_tenant, 1)
    foreign = engine.add_foreign("someone-elses", {"app": "db"})
    [theirs] = engine.by_label(cloacina_tenant=tenant_label("globex"))
    actuator.reconcile(tenant, 2)
    actuator.reconcile(tenant, 0)
    actuator.stop_all(tenant)
    assert theirs.signals == [] and theirs.state == "running"
    assert foreign.signals == [] and foreign.state == "running"


def test_another_installations_agents_on_the_same_daemon_are_never_touched(
    engine, actuator, tenant
):
    """Two installations on one daemon: each one's containers look like a deleted tenant's
    to the other; the installation label keeps their hands off. A managed container without
    the label (started before it existed) is still ours: its deleted tenant's agent goes."""
    managed = {"cloacina.managed": "true", "cloacina.agent": "x", "cloacina.key": ""}
    elsewhere = engine.add_foreign(
        "theirs",
        {**managed, "cloacina.tenant": "ghost", "cloacina.installation": "another-installation"},
    )
    legacy = engine.add_foreign("legacy", {**managed, "cloacina.tenant": "gone"})
    Tenant.objects.filter(pk=tenant.pk).update(desired_count=1)
    reconcile_all(actuator)
    assert actuator.managed_labels() == {tenant_label("acme"), "gone"}
    assert elsewhere.signals == [] and elsewhere.state == "running"
    assert legacy.signals == ["SIGTERM"]
    assert Installation.current_id() != "another-installation"


def test_scale_down_drains_the_newest_and_revokes_its_key_once_gone(
    engine, actuator, tenant, clock
):
    actuator.reconcile(tenant, 3)
    boxes = sorted(engine.containers.values(), key=lambda c: c.created)
    agents = [register(c, tenant) for c in boxes]
    result = actuator.reconcile(tenant, 1)
    assert result.stopped == 2
    oldest, middle, newest = boxes
    assert oldest.signals == []
    assert middle.signals == ["SIGTERM"] and newest.signals == ["SIGTERM"]
    # still finishing their work: not removed, not counted, their roster rows draining
    assert {c.state for c in boxes} == {"running"}
    assert [a.name for a in Agent.objects.filter(state="draining").order_by("name")] == sorted(
        [agents[1].name, agents[2].name]
    )
    assert [h.name for h in actuator.actual(tenant)] == [oldest.name]
    assert actuator.reconcile(tenant, 1).changed is False  # a drain in progress is left alone
    engine.exit(newest.id)  # it finished its work and exited
    actuator.reconcile(tenant, 1)
    assert newest.id not in engine.containers
    assert ApiKey.objects.get(lookup=newest.labels["cloacina.key"]).revoked_at is not None
    assert ApiKey.objects.get(lookup=middle.labels["cloacina.key"]).revoked_at is None
    # the one that never finishes is killed after the drain timeout
    clock.now += 31
    actuator.reconcile(tenant, 1)
    assert middle.signals == ["SIGTERM", "SIGKILL"]
    actuator.reconcile(tenant, 1)
    assert set(engine.containers) == {oldest.id}
    assert ApiKey.objects.get(lookup=middle.labels["cloacina.key"]).revoked_at is not None


def test_a_crashed_container_is_replaced_under_its_name_with_a_new_key(engine, actuator, tenant):
    actuator.reconcile(tenant, 1)
    [crashed] = engine.containers.values()
    engine.exit(crashed.id, code=1)
    result = actuator.reconcile(tenant, 1)
    assert (result.restarted, result.started) == (1, 0)
    [replacement] = engine.containers.values()
    assert replacement.id != crashed.id and replacement.name == crashed.name
    assert replacement.labels["cloacina.key"] != crashed.labels["cloacina.key"]
    assert ApiKey.objects.get(lookup=crashed.labels["cloacina.key"]).revoked_at is not None


def test_disabled_and_deleted_tenants_agents_are_stopped(engine, actuator, tenant, other_tenant):
    Tenant.objects.filter(pk=tenant.pk).update(desired_count=1)
    Tenant.objects.filter(pk=other_tenant.pk).update(desired_count=1)
    reconcile_all(actuator)
    [ours] = engine.by_label(cloacina_tenant=tenant_label("acme"))
    [theirs] = engine.by_label(cloacina_tenant=tenant_label("globex"))
    Tenant.objects.filter(pk=tenant.pk).update(is_active=False)
    other_tenant.delete()
    reconcile_all(actuator)
    assert ours.signals == ["SIGTERM"]
    assert theirs.signals == ["SIGTERM"]
    assert (
        ApiKey.objects.filter(tenant=tenant, revoked_at__isnull=True).count() == 1
    )  # until it exits
    engine.exit(ours.id)
    reconcile_all(actuator)
    assert ApiKey.objects.filter(tenant=tenant, revoked_at__isnull=True).count() == 0
    assert ours.id not in engine.containers


def test_the_network_and_resource_settings_reach_every_container(engine, tenant):
    settings = ControlSettings(
        server_url="http://127.0.0.1:8000", agent_image="cloacina:test", docker_network="host",
        agent_cpu_limit="500m", agent_memory_limit="1Gi",
    )  # fmt: skip
    actuator = DockerActuator(
        settings, client_factory=lambda: docker.DockerClient(base_url=engine.base_url)
    )
    actuator.reconcile(tenant, 2)
    for c in engine.containers.values():
        host = c.config["HostConfig"]
        assert host["NetworkMode"] == "host"  # agents reach the server on this machine's loopback
        assert (host["NanoCpus"], host["Memory"]) == (5 * 10**8, 2**30)
