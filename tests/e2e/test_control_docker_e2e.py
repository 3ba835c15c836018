"""The docker actuator against a real Docker engine: `serve --actuator docker` on the test
database, agent containers of the project image (scripts/build-agent-image) running
`runagent` on the host network, so they reach `serve` on 127.0.0.1 and nothing else.

One fleet's life in two `serve` runs (CI's budget is tight; each step depends on the last):
provision 2 → two hardened containers register and work lands on both; `docker kill` of the
one holding work → evicted, the survivor does the work, nothing completes twice, the
crashed container replaced; `serve` restarted → it adopts the containers by label (no new
containers, no new keys); deprovision → the newest is drained, removed, its key revoked;
the tenant deactivated → its last container goes.

Skipped, with the missing piece named, where no engine can run (tests/support/real_docker.py);
the actuator's logic is covered against a fake Engine API in
tests/integration/test_control_docker.py.
"""

from __future__ import annotations

import uuid
from collections import Counter

import docker
import pytest

from agents.models import Agent
from fleet.control.actuators.naming import tenant_label
from fleet.models import ApiKey, Eviction, TaskExecution, TaskOutcome, Tenant, WorkflowExecution
from tests.support.agents import live_agents
from tests.support.factories import make_package
from tests.support.processes import (
    READY_LINE,
    Processes,
    ServeHandle,
    control_env,
    free_port,
    wait_for_http,
)
from tests.support.real_docker import BUILD_TIMEOUT_S, agent_image, remove_containers
from tests.support.server_api import Api
from tests.support.waiting import wait_until
from tests.support.workloads import SLOW_TASKS

pytestmark = [pytest.mark.e2e, pytest.mark.docker]

# What the containers get (asserted through `docker inspect`): small, so two fit anywhere.
CPU_LIMIT, CPU_REQUEST = "1", "250m"
MEMORY_LIMIT, MEMORY_REQUEST = "768Mi", "256Mi"
CONTAINER_BOOT_S = 90  # a cold container imports Django on a loaded 2-core CI machine


@pytest.fixture(scope="module")
def image() -> str:
    return agent_image()


@pytest.fixture
def engine(image):
    client = docker.from_env()
    yield client
    client.close()


@pytest.fixture
def fleet_tenant(transactional_db, engine):
    """A tenant with a name of its own (its containers' label is unique to this run) and
    a write key; its containers are removed however the test ends."""
    tenant = Tenant.objects.create(name=f"dockere2e-{uuid.uuid4().hex[:8]}")
    yield tenant, ApiKey.mint("write", tenant)[1]
    remove_containers(engine, tenant_label(tenant.name))


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


def docker_serve(procs: Processes, port: int, image: str, name: str) -> ServeHandle:
    """`serve --actuator docker` on ``port``; its agents run ``image`` on the host network."""
    env = control_env(
        procs,
        CLOACINA_FLEET_SERVER_URL=f"http://127.0.0.1:{port}",
        CLOACINA_DOCKER_NETWORK="host",
        CLOACINA_AGENT_IMAGE=image,
        CLOACINA_AGENT_MAX_CONCURRENCY="1",
        CLOACINA_AGENT_CPU_LIMIT=CPU_LIMIT,
        CLOACINA_AGENT_CPU_REQUEST=CPU_REQUEST,
        CLOACINA_AGENT_MEMORY_LIMIT=MEMORY_LIMIT,
        CLOACINA_AGENT_MEMORY_REQUEST=MEMORY_REQUEST,
    )
    process = procs.start(["serve", "--port", str(port), "--actuator", "docker"], name, env)
    url = process.wait_for_output(READY_LINE, 60).group(1)
    wait_for_http(f"{url}/healthz", timeout=10.0, process=process)
    return ServeHandle(process, url)


def containers(engine: docker.DockerClient, tenant: Tenant) -> dict[str, object]:
    """The tenant's containers by id, running or not: the list only (``sparse``), never an
    inspect per container, which would race the actuator removing one."""
    label = f"cloacina.tenant={tenant_label(tenant.name)}"
    filters = {"label": ["cloacina.managed=true", label]}
    return {c.id: c for c in engine.containers.list(all=True, sparse=True, filters=filters)}


def labels(container) -> dict[str, str]:
    return container.attrs["Labels"]  # a sparse (listed) container's labels


def container_logs(engine: docker.DockerClient, tenant: Tenant, serve: ServeHandle):
    """A ``logs`` callable for wait_until: the serve tail and every agent container's."""

    def render() -> str:
        parts = [f"=== {serve.process.name}\n{serve.process.tail(40)}"]
        for c in containers(engine, tenant).values():
            try:
                tail = c.logs(tail=15).decode(errors="replace")
            except docker.errors.NotFound:
                tail = "(removed meanwhile)"
            parts.append(f"--- {labels(c)['cloacina.agent']} ({c.attrs['State']})\n{tail}")
        return "\n".join(parts)

    return render


def assert_hardened(engine: docker.DockerClient, container_id: str) -> None:
    """What `docker inspect` shows: uid 10001, read-only root, no capabilities, no
    privilege gain, the configured limits, the host network."""
    inspected = engine.api.inspect_container(container_id)
    config, host = inspected["Config"], inspected["HostConfig"]
    assert config["User"] == "10001:10001"
    assert host["ReadonlyRootfs"] is True
    assert host["CapDrop"] == ["ALL"] and not host["CapAdd"]
    assert host["SecurityOpt"] == ["no-new-privileges:true"]
    assert host["Privileged"] is False
    assert (host["NanoCpus"], host["CpuShares"]) == (10**9, 256)
    assert (host["Memory"], host["MemoryReservation"]) == (768 * 2**20, 256 * 2**20)
    assert host["NetworkMode"] == "host"
    assert config["Entrypoint"] == ["python", "manage.py"] and config["Cmd"][0] == "runagent"
    # the key is in the environment only, never on the command line
    assert not any(part.startswith("clk_") for part in config["Cmd"])


def applied_once(execution_id: str) -> bool:
    """Every task of the execution has exactly one applied outcome."""
    applied = Counter(
        TaskOutcome.objects.filter(
            task_execution__workflow_execution_id=execution_id, applied=True
        ).values_list("task_execution_id", flat=True)
    )
    tasks = TaskExecution.objects.filter(workflow_execution_id=execution_id).count()
    return len(applied) == tasks and set(applied.values()) == {1}


def completed(execution_id: str, logs, timeout: float = 60) -> WorkflowExecution:
    return wait_until(
        lambda: WorkflowExecution.objects.filter(pk=execution_id, status="Completed").first(),
        timeout=timeout,
        what=f"execution {execution_id} to complete",
        logs=logs,
    )


# The first run on a machine builds the image (module fixture, counted in this test's time).
@pytest.mark.timeout(BUILD_TIMEOUT_S + 300)
def test_a_fleet_of_agent_containers_on_a_real_engine(procs, image, engine, fleet_tenant):
    tenant, key = fleet_tenant
    pair = [{"id": t, "function": "demo.steps:slow"} for t in ("a", "b")]
    make_package(tenant, pair, SLOW_TASKS, name="pair", workflow="pair")
    make_package(tenant, [pair[0]], SLOW_TASKS, name="solo", workflow="solo")
    port = free_port()
    serve = docker_serve(procs, port, image, "serve-first")
    api, logs = Api(serve, key), container_logs(engine, tenant, serve)

    # Provision 2: two hardened containers register; a two-task execution uses both.
    for expected in (1, 2):
        assert api.post("/fleet/provision").json()["desired_count"] == expected
    agents = wait_until(
        lambda: (a := live_agents(tenant)) and len(a) == 2 and a,
        timeout=CONTAINER_BOOT_S,
        what="two agent containers to register",
        logs=logs,
    )
    boxes = containers(engine, tenant)
    assert len(boxes) == 2
    for box in boxes.values():
        assert_hardened(engine, box.id)
    by_name = {labels(b)["cloacina.agent"]: b for b in boxes.values()}
    assert set(by_name) == {a.name for a in agents}
    for agent in agents:  # each registered with the key minted for its own container
        assert (
            ApiKey.objects.get(pk=agent.api_key_id).lookup
            == labels(by_name[agent.name])["cloacina.key"]
        )
    first = api.start("pair", {"sleep_s": 1.5})
    completed(first, logs)
    ran_on = set(
        TaskExecution.objects.filter(workflow_execution_id=first).values_list("agent_id", flat=True)
    )
    assert ran_on == {a.pk for a in agents}  # one task each: concurrency 1, two free agents
    wait_until(
        lambda: all(a.managed_by == "docker" for a in live_agents(tenant)),
        what="the agents to be marked managed_by=docker",
        logs=logs,
    )

    # `docker kill` the agent holding work: evicted; the survivor does it; nothing twice.
    solo = api.start("solo", {"sleep_s": 3})
    task = wait_until(
        lambda: TaskExecution.objects.filter(
            workflow_execution_id=solo, status="Running", agent__isnull=False
        ).first(),
        what="the solo task to run on an agent",
        logs=logs,
    )
    victim = Agent.objects.get(pk=task.agent_id)
    [survivor] = [a for a in agents if a.pk != victim.pk]
    by_name[victim.name].kill()  # SIGKILL: no drain, no goodbye
    completed(solo, logs)
    task.refresh_from_db()
    assert (task.status, task.agent_id) == ("Completed", survivor.pk)
    eviction = Eviction.objects.get(agent=victim)
    assert (eviction.in_flight, eviction.reassigned) == (1, 1)  # the solo task, moved
    assert not TaskOutcome.objects.filter(task_execution=task, agent_name=victim.name).exists()
    assert applied_once(solo) and applied_once(first)
    # the crashed container is replaced under its name with a new key; the old key revoked
    replacement = wait_until(
        lambda: (
            Agent.objects.filter(tenant=tenant, state="live", name=victim.name)
            .exclude(pk=victim.pk)
            .first()
        ),
        timeout=CONTAINER_BOOT_S,
        what="a replacement container under the victim's name",
        logs=logs,
    )
    assert replacement.api_key_id != victim.api_key_id
    wait_until(
        lambda: ApiKey.objects.get(pk=victim.api_key_id).revoked_at is not None,
        what="the killed agent's key to be revoked",
        logs=logs,
    )
    wait_until(
        lambda: by_name[victim.name].id not in containers(engine, tenant),
        what="the killed container to be removed",
        logs=logs,
    )

    # Restart serve: it adopts the running containers — no new ones, no new keys.
    before = set(containers(engine, tenant))
    keys_before = set(
        ApiKey.objects.filter(tenant=tenant, role="agent").values_list("pk", flat=True)
    )
    assert len(before) == 2
    serve.process.stop()
    serve = docker_serve(procs, port, image, "serve-second")
    api, logs = Api(serve, key), container_logs(engine, tenant, serve)
    after_restart = api.start("pair", {"sleep_s": 0.5})
    completed(after_restart, logs)
    assert applied_once(after_restart)
    live = wait_until(
        lambda: (a := live_agents(tenant)) and len(a) == 2 and a,
        what="both adopted agents live on the new serve",
        logs=logs,
    )
    assert set(containers(engine, tenant)) == before
    for container_id in before:  # the replacement is as hardened as the first two
        assert_hardened(engine, container_id)
    assert {a.api_key_id for a in live} <= keys_before
    assert (
        set(ApiKey.objects.filter(tenant=tenant, role="agent").values_list("pk", flat=True))
        == keys_before
    )

    # Deprovision: the newest container is drained (not killed), removed, its key revoked.
    newest = max(containers(engine, tenant).values(), key=lambda c: c.attrs["Created"])
    assert api.post("/fleet/deprovision").json()["desired_count"] == 1
    wait_until(
        lambda: newest.id not in containers(engine, tenant),
        what="the newest container to drain, stop and be removed",
        logs=logs,
    )
    drained = Agent.objects.filter(api_key__lookup=labels(newest)["cloacina.key"]).latest("pk")
    assert drained.drain_requested_at is not None
    assert not Eviction.objects.filter(agent=drained).exists()  # left cleanly
    wait_until(
        lambda: ApiKey.objects.get(pk=drained.api_key_id).revoked_at is not None,
        what="the drained agent's key to be revoked",
        logs=logs,
    )

    # A deactivated tenant's containers go, and their keys with them.
    Tenant.objects.filter(pk=tenant.pk).update(is_active=False)
    wait_until(
        lambda: not containers(engine, tenant),
        what="the deactivated tenant's containers to be removed",
        logs=logs,
    )
    wait_until(
        lambda: (
            not ApiKey.objects.filter(tenant=tenant, role="agent", revoked_at__isnull=True).exists()
        ),
        what="every agent key of the tenant to be revoked",
        logs=logs,
    )
