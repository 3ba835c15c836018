"""The control loop for real on one machine: `serve --actuator process` starting, draining
and replacing real `runagent` processes, and the autoscaler moving desired_count."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from agents.models import Agent
from fleet.models import (
    ApiKey,
    AutoscaleDecision,
    Eviction,
    TaskExecution,
    Tenant,
    WorkflowExecution,
)
from tests.support.agents import live_agents, seq_of
from tests.support.factories import NOOP_SOURCE, make_package
from tests.support.processes import Processes, control_env, diagnostics
from tests.support.server_api import Api
from tests.support.waiting import wait_until
from tests.support.workloads import GATED_TASKS, SLOW_TASKS

pytestmark = pytest.mark.e2e


def runagent_children(serve) -> list[psutil.Process]:
    """The serve process's live `runagent` children (exited, not yet reaped ones excluded)."""
    found = []
    for child in psutil.Process(serve.process.pid).children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "runagent" in child.cmdline():
                found.append(child)
        except psutil.Error:
            pass  # exited meanwhile
    return found


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


@pytest.fixture
def acme(transactional_db):
    tenant = Tenant.objects.create(name="acme")
    return tenant, ApiKey.mint("write", tenant)[1]


def test_provision_to_three_then_deprovision_drains_the_newest(procs, acme):
    tenant, key = acme
    serve = procs.serve(env=control_env(procs))
    api, logs = Api(serve, key), diagnostics(procs, serve)
    for expected in (1, 2, 3):
        res = api.post("/fleet/provision")
        assert res.status_code == 200 and res.json()["desired_count"] == expected
    agents = wait_until(
        lambda: (a := live_agents(tenant)) and len(a) == 3 and a, what="3 live agents", logs=logs
    )
    wait_until(
        lambda: all(a.managed_by == "process" for a in live_agents(tenant)),
        what="the agents to be marked managed_by=process",
        logs=logs,
    )
    newest = max(agents, key=lambda a: seq_of(a.name))
    res = api.post("/fleet/deprovision")
    assert res.status_code == 200 and res.json()["desired_count"] == 2
    gone = wait_until(
        lambda: Agent.objects.filter(pk=newest.pk, state="stopped").first(),
        what="the newest agent to drain and deregister",
        logs=logs,
    )
    assert gone.drain_requested_at is not None  # asked to drain, not killed
    assert not Eviction.objects.filter(agent=newest).exists()  # left cleanly, not evicted
    assert sorted(a.name for a in live_agents(tenant)) == sorted(
        a.name for a in agents if a.pk != newest.pk
    )
    wait_until(
        lambda: ApiKey.objects.get(pk=gone.api_key_id).revoked_at is not None,
        what="the drained agent's key to be revoked",
        logs=logs,
    )
    body = api.get("/fleet").json()
    assert body["desired_count"] == 2
    # A deprovisioned agent is stopped, not dead (issue 15).
    assert sorted(a["state"] for a in body["agents"]) == ["live", "live", "stopped"]
    assert sorted(a["phase"] for a in body["agents"])[-1] == "stopped"


def test_scale_down_lets_in_flight_work_finish(procs, acme):
    tenant, key = acme
    make_package(tenant, [{"id": "slow", "function": "demo.steps:slow"}], SLOW_TASKS)
    serve = procs.serve(env=control_env(procs))
    api, logs = Api(serve, key), diagnostics(procs, serve)
    api.post("/fleet/provision")
    [agent] = wait_until(lambda: live_agents(tenant), what="an agent", logs=logs)
    execution_id = api.start("demo", {"sleep_s": 3})
    task = wait_until(
        lambda: TaskExecution.objects.filter(
            workflow_execution_id=execution_id, status="Running", agent=agent
        ).first(),
        what="the task to run on the agent",
        logs=logs,
    )
    assert api.post("/fleet/deprovision").json()["desired_count"] == 0
    wait_until(
        lambda: Agent.objects.filter(pk=agent.pk, state__in=["draining", "stopped"]).exists(),
        what="the agent to start draining",
        logs=logs,
    )
    task.refresh_from_db()
    assert task.status == "Running"  # still working while it drains
    execution = wait_until(
        lambda: WorkflowExecution.objects.filter(pk=execution_id, status="Completed").first(),
        what="the execution to complete on the draining agent",
        logs=logs,
    )
    task.refresh_from_db()
    assert (task.status, task.attempt, task.agent_id) == ("Completed", 1, agent.pk)
    assert execution.final_context["slept"] is True
    wait_until(
        lambda: Agent.objects.filter(pk=agent.pk, state="stopped").exists(),
        what="the drained agent to deregister",
        logs=logs,
    )
    assert not Eviction.objects.filter(agent=agent).exists()


def test_a_crashed_agent_is_restarted_and_a_disabled_tenant_stopped(procs, acme):
    tenant, key = acme
    serve = procs.serve(env=control_env(procs))
    api, logs = Api(serve, key), diagnostics(procs, serve)
    api.post("/fleet/provision")
    [agent] = wait_until(lambda: live_agents(tenant), what="an agent", logs=logs)
    [child] = runagent_children(serve)
    assert "CLOACINA_AGENT_API_KEY" not in " ".join(child.cmdline())
    assert not any(part.startswith("clk_") for part in child.cmdline())  # the key is not in argv
    os.kill(child.pid, signal.SIGKILL)
    replacement = wait_until(
        lambda: (
            Agent.objects.filter(tenant=tenant, state="live", name=agent.name)
            .exclude(pk=agent.pk)
            .first()
        ),
        what="a replacement under the same name",
        logs=logs,
    )
    assert replacement.api_key_id != agent.api_key_id
    wait_until(
        lambda: ApiKey.objects.get(pk=agent.api_key_id).revoked_at is not None,
        what="the crashed agent's key to be revoked",
        logs=logs,
    )
    Tenant.objects.filter(pk=tenant.pk).update(is_active=False)
    wait_until(
        lambda: not runagent_children(serve),
        what="the disabled tenant's agent processes to stop",
        logs=logs,
    )
    wait_until(
        lambda: (
            not ApiKey.objects.filter(tenant=tenant, role="agent", revoked_at__isnull=True).exists()
        ),
        what="the stopped agent's key to be revoked",
        logs=logs,
    )


def test_the_autoscaler_scales_up_under_load_and_down_when_idle(procs, acme, tmp_path):
    tenant, key = acme
    Tenant.objects.filter(pk=tenant.pk).update(max_agents_override=3)
    tasks = [{"id": f"t{i}", "function": "demo.steps:held"} for i in range(3)]
    make_package(tenant, tasks, GATED_TASKS)
    env = control_env(
        procs,
        CLOACINA_AUTOSCALE="true",
        CLOACINA_AGENT_MAX_CONCURRENCY="1",
        CLOACINA_AGENT_LIVENESS_MISSES="10",  # a starved CI machine must not evict anyone
    )
    serve = procs.serve(env=env)
    api, logs = Api(serve, key), diagnostics(procs, serve)
    # Zero agents and three queued tasks that hold their slots until the gate opens: the
    # backlog alone must bring the fleet up, one agent at a time, however slowly agents start.
    gate = tmp_path / "gate"
    execution_id = api.start("demo", {"gate": str(gate)})
    wait_until(
        lambda: Tenant.objects.get(pk=tenant.pk).desired_count == 3,
        what="the autoscaler to reach the limit of 3",
        timeout=90,
        logs=logs,
    )
    wait_until(
        lambda: TaskExecution.objects.filter(tenant=tenant, status="Running").count() == 3,
        what="each of the three agents to hold a task",
        timeout=90,
        logs=logs,
    )
    gate.write_text("open")
    wait_until(
        lambda: WorkflowExecution.objects.filter(pk=execution_id, status="Completed").exists(),
        what="the execution to complete",
        timeout=60,
        logs=logs,
    )
    ups = list(
        AutoscaleDecision.objects.filter(tenant=tenant, decision="up")
        .order_by("at")
        .values_list("old_desired", "new_desired", "reason")
    )
    assert [(o, n) for o, n, _ in ups] == [(0, 1), (1, 2), (2, 3)]
    assert "backlog 3 > 0 free slot(s)" in ups[0][2]
    assert len({t.agent_id for t in TaskExecution.objects.filter(tenant=tenant)}) == 3
    # Idle now: utilization 0 → −1 per cooldown down to the floor (0), each agent drained.
    wait_until(
        lambda: Tenant.objects.get(pk=tenant.pk).desired_count == 0,
        what="the autoscaler to scale the idle tenant down to 0",
        timeout=60,
        logs=logs,
    )
    wait_until(lambda: not live_agents(tenant), what="every agent to leave", logs=logs)
    downs = list(
        AutoscaleDecision.objects.filter(tenant=tenant, decision="down")
        .order_by("at")
        .values_list("old_desired", "new_desired")
    )
    assert downs == [(3, 2), (2, 1), (1, 0)]
    assert not Eviction.objects.filter(tenant=tenant).exists()  # drained, never killed


def test_a_gpu_pool_starts_agents_with_its_labels_that_run_the_gpu_work(procs, acme):
    """GPU work waits (it does not fail) while no GPU agent lives, then runs on the agent
    the process actuator starts for the GPU pool with that pool's labels."""
    tenant, key = acme
    tasks = [
        {"id": "cpu", "function": "demo.steps:a"},
        {"id": "gpu", "function": "demo.steps:b", "tags": ["gpu"], "capability": "cuda"},
    ]
    make_package(tenant, tasks, NOOP_SOURCE)
    serve = procs.serve(env=control_env(procs))
    api, logs = Api(serve, key), diagnostics(procs, serve)
    res = api.post(
        "/fleet/pools",
        {"name": "gpu", "tags": ["gpu"], "capabilities": ["cuda"], "max_concurrency": 1},
    )
    assert res.status_code == 201, res.text
    assert api.post("/fleet/provision").json()["desired_count"] == 1  # the default pool: CPU
    [cpu_agent] = wait_until(lambda: live_agents(tenant), what="the CPU agent", logs=logs)
    assert cpu_agent.tags == [] and cpu_agent.max_concurrency == 2
    execution_id = api.start("demo", {})
    waiting = wait_until(
        lambda: (
            TaskExecution.objects.filter(
                workflow_execution_id=execution_id, task_name="gpu", status="Ready"
            )
            .exclude(wait_reason="")
            .first()
        ),
        what="the GPU task to wait for the GPU pool",
        logs=logs,
    )
    assert "pool 'gpu' can run it and can be scaled up" in waiting.wait_reason
    res = api.post("/fleet/pools/gpu/provision")
    assert res.status_code == 200 and res.json()["desired_count"] == 1, res.text
    gpu_agent = wait_until(
        lambda: Agent.objects.filter(tenant=tenant, state="live", tags__contains=["gpu"]).first(),
        what="the GPU pool's agent to register",
        logs=logs,
    )
    assert sorted(gpu_agent.tags) == ["gpu", "pool:gpu"]
    assert gpu_agent.capabilities == ["cuda"] and gpu_agent.max_concurrency == 1
    assert "-gpu-" in gpu_agent.name and gpu_agent.managed_by in ("", "process")
    execution = wait_until(
        lambda: WorkflowExecution.objects.filter(pk=execution_id, status="Completed").first(),
        what="the execution to complete",
        logs=logs,
    )
    by_name = {t.task_name: t for t in TaskExecution.objects.filter(workflow_execution=execution)}
    assert by_name["gpu"].agent_id == gpu_agent.pk
    assert by_name["gpu"].error_type == ""
    pools = {p["name"]: p for p in api.get("/fleet/pools").json()["pools"]}
    assert (pools["default"]["desired_count"], pools["gpu"]["desired_count"]) == (1, 1)
    assert pools["gpu"]["agents_live"] == 1
