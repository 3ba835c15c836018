"""Each actuator starts a pool's agents with the pool's labels and counts them per pool;
agents without a pool label (started before pools existed) are the default pool's.

Docker and Kubernetes against their fakes at the HTTP boundary (tests/support/fakes/);
the process actuator with real `runagent` children in tests/e2e/test_control_process_e2e.py.
"""

from __future__ import annotations

import docker
import pytest
from kubernetes import client as k8s

from fleet.control import limits, pools
from fleet.control.actuators.base import PoolSpec
from fleet.control.actuators.docker import DockerActuator
from fleet.control.actuators.kubernetes import KubernetesActuator
from fleet.control.actuators.naming import tenant_namespace
from fleet.control.actuators.settings import ControlSettings
from fleet.control.reconciler import reconcile_all
from fleet.models import ApiKey
from tests.support.fakes.docker_engine import FakeDockerEngine
from tests.support.fakes.kubernetes_api import SETTINGS, FakeKubernetesApi

pytestmark = pytest.mark.django_db

GPU = PoolSpec("gpu", 1, ("gpu", "pool:gpu"), ("cuda",), 1, "500m", "2Gi", 1)


@pytest.fixture
def engine():
    with FakeDockerEngine() as fake:
        yield fake


@pytest.fixture
def docker_actuator(engine):
    settings = ControlSettings(
        server_url="http://cloacina.internal:8000", agent_image="cloacina:test",
        agent_max_concurrency=3, agent_drain_timeout_s=30,
    )  # fmt: skip
    return DockerActuator(
        settings, client_factory=lambda: docker.DockerClient(base_url=engine.base_url)
    )


@pytest.fixture
def kube():
    with FakeKubernetesApi() as fake:
        yield fake


@pytest.fixture
def kube_actuator(kube):
    return KubernetesActuator(SETTINGS, k8s.ApiClient(k8s.Configuration(host=kube.host)))


def test_docker_starts_each_pools_containers_with_its_labels(engine, docker_actuator, tenant):
    result = docker_actuator.reconcile(tenant, [PoolSpec("default", 1), GPU])
    assert (result.started, result.desired) == (2, 2)
    by_pool = {c.labels.get("cloacina.pool", "default"): c for c in engine.containers.values()}
    assert set(by_pool) == {"default", "gpu"}
    assert "cloacina.pool" not in by_pool["default"].labels  # unlabelled: the default pool
    gpu = by_pool["gpu"]
    command = gpu.config["Cmd"]
    assert command[command.index("--tags") + 1] == "gpu,pool:gpu"
    assert command[command.index("--capabilities") + 1] == "cuda"
    assert command[command.index("--max-concurrency") + 1] == "1"
    host = gpu.config["HostConfig"]
    assert (host["NanoCpus"], host["Memory"]) == (500_000_000, 2 * 2**30)
    assert host["DeviceRequests"][0]["Count"] == 1
    default_command = by_pool["default"].config["Cmd"]
    assert "--tags" not in default_command
    assert default_command[default_command.index("--max-concurrency") + 1] == "3"
    assert sorted(h.pool for h in docker_actuator.actual(tenant)) == ["default", "gpu"]
    # Counted per pool: the GPU pool down to 0 drains only its container.
    result = docker_actuator.reconcile(tenant, [PoolSpec("default", 1), PoolSpec("gpu", 0)])
    assert (result.started, result.stopped) == (0, 1)
    assert [h.pool for h in docker_actuator.actual(tenant)] == ["default"]


def test_docker_drains_the_containers_of_a_deleted_pool(engine, docker_actuator, tenant):
    docker_actuator.reconcile(tenant, [PoolSpec("default", 0), GPU])
    result = docker_actuator.reconcile(tenant, 0)  # the pool is gone: only default, at 0
    assert result.stopped == 1 and docker_actuator.actual(tenant) == []


def test_kubernetes_runs_a_deployment_per_pool(kube, kube_actuator, tenant):
    result = kube_actuator.reconcile(tenant, [PoolSpec("default", 2), GPU])
    assert (result.started, result.desired) == (3, 3)
    ns = tenant_namespace("acme")
    assert kube.get("deployments", ns, "cloacina-agent")["spec"]["replicas"] == 2
    gpu = kube.get("deployments", ns, "cloacina-agent-gpu")
    assert gpu["spec"]["replicas"] == 1
    assert gpu["metadata"]["labels"]["cloacina.io/pool"] == "gpu"
    assert kube.get("networkpolicies", ns, "cloacina-agent-gpu") is not None
    assert kube.get("secrets", ns, "cloacina-agent-key-gpu") is not None
    assert sorted(h.pool for h in kube_actuator.actual(tenant)) == ["default", "default", "gpu"]
    # Two keys, one per pool: rotating one pool's never touches the other's.
    keys = ApiKey.objects.filter(tenant=tenant, revoked_at__isnull=True)
    assert sorted(keys.values_list("label", flat=True)) == [
        f"kubernetes actuator: {ns}",
        f"kubernetes actuator: {ns}/gpu",
    ]
    # A deleted pool's Deployment goes to 0; stopping the tenant revokes every pool's key.
    result = kube_actuator.reconcile(tenant, 2)
    assert result.stopped == 1
    assert kube.get("deployments", ns, "cloacina-agent-gpu")["spec"]["replicas"] == 0
    assert kube_actuator.stop_all(tenant) == 2
    assert not ApiKey.objects.filter(tenant=tenant, revoked_at__isnull=True).exists()
    assert kube.get("secrets", ns, "cloacina-agent-key-gpu") is None


def test_the_reconciler_drives_pools_through_the_actuator(engine, docker_actuator, tenant):
    pools.create_pool(tenant, "t", "gpu", {"tags": ["gpu"], "gpu": 1})
    limits.provision(tenant, "t")
    pools.provision_pool(tenant, "gpu", "t")
    reconcile_all(docker_actuator)
    assert sorted(h.pool for h in docker_actuator.actual(tenant)) == ["default", "gpu"]
    pools.delete_pool(tenant, "gpu", "t")
    reconcile_all(docker_actuator)
    assert [h.pool for h in docker_actuator.actual(tenant)] == ["default"]
