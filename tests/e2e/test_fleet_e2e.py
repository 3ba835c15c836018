"""The fleet end to end: real `serve --default-executor fleet`, real `runagent` processes,
real WebSockets, the embedded PostgreSQL."""

from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter

import httpx
import pytest

from artifacts.store.testing import build_archive, example_archive, manifest_toml
from fleet.models import DeliveryOutbox, Eviction, TaskExecution, TaskOutcome
from tests.support.keys import cli_agent_key, cli_tenant_key
from tests.support.processes import Processes, fleet_serve, free_port, start_agent
from tests.support.server_api import execution, metric, start, upload, wait_terminal
from tests.support.waiting import wait_until
from tests.support.workloads import SLOW_ONCE_SOURCE

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


def slow_package(tasks=None, name="slow", workflow="slow") -> bytes:
    tasks = tasks or [{"id": "slow", "function": "slowpkg.steps:slow_once", "timeout_s": 60}]
    return build_archive(
        {
            "cloacina.toml": manifest_toml(tasks, name=name, workflow=workflow),
            "workflow/slowpkg/__init__.py": "",
            "workflow/slowpkg/steps.py": SLOW_ONCE_SOURCE,
        }
    )


def test_the_diamond_completes_on_the_fleet_as_it_does_in_process(procs, tmp_path):
    key = cli_tenant_key(procs)
    akey = cli_agent_key(procs)
    context = {"input_rows": [4, 1, 7], "fail_once": True}

    # In-process first, for the reference result.
    server = procs.serve()
    upload(server, key, example_archive("etl-demo"))
    local = wait_terminal(
        server, key, start(server, key, "etl", {**context, "marker_path": str(tmp_path / "m1")})
    )
    server.process.stop()

    server = fleet_serve(procs)
    start_agent(procs, server, akey, "w1", slots=2)
    start_agent(procs, server, akey, "w2", slots=2)
    fleet_id = start(server, key, "etl", {**context, "marker_path": str(tmp_path / "m2")})
    fleet = wait_terminal(server, key, fleet_id, timeout=60)

    assert local["status"] == fleet["status"] == "Completed"
    strip = lambda c: {k: v for k, v in c.items() if k != "marker_path"}  # noqa: E731
    assert strip(fleet["context"]) == strip(local["context"])
    assert fleet["context"]["report"] == "loaded 3 rows: sum=12 max=7"
    tasks = {t["task_id"]: t for t in fleet["tasks"]}
    assert tasks["extract"]["attempt"] == 2  # the task's own retry policy, on the fleet
    assert {t["agent"] for t in tasks.values()} <= {"w1", "w2"}
    assert all(t["agent"] is None for t in local["tasks"])
    rows = DeliveryOutbox.objects.filter(task_execution__workflow_execution_id=fleet_id)
    assert rows.count() == 5 and set(rows.values_list("state", flat=True)) == {"acked"}


def test_kill_9_of_an_agent_mid_task_fails_over_to_the_survivor(procs, tmp_path):
    key = cli_tenant_key(procs)
    akey = cli_agent_key(procs)
    server = fleet_serve(procs)
    upload(server, key, slow_package())
    agents = {name: start_agent(procs, server, akey, name) for name in ("w1", "w2")}
    evicted_before = metric(server, "cloacina_fleet_agents_evicted_total")
    marker = tmp_path / "slow-started"
    execution_id = start(server, key, "slow", {"marker": str(marker), "sleep_s": 60})

    wait_until(marker.exists, what="the first run started")
    victim = wait_until(lambda: execution(server, key, execution_id)["tasks"][0]["agent"])
    killed_at = time.time()
    agents[victim].kill_group()  # kill -9 the agent and its task processes

    body = wait_terminal(server, key, execution_id, timeout=30)
    assert body["status"] == "Completed", body
    task = body["tasks"][0]
    survivor = ({"w1", "w2"} - {victim}).pop()
    assert (task["agent"], task["attempt"], body["context"]["who"]) == (survivor, 1, "second")
    failover_s = (
        TaskExecution.objects.get(
            pk=DeliveryOutbox.objects.get().task_execution_id
        ).finished_at.timestamp()
        - killed_at
    )
    assert failover_s < 0.5 * 3 + 2, f"failover took {failover_s:.2f}s"
    eviction = Eviction.objects.get(agent_name=victim)
    assert (eviction.in_flight, eviction.reassigned) == (1, 1)
    assert metric(server, "cloacina_fleet_agents_evicted_total") == evicted_before + 1
    assert metric(server, "cloacina_fleet_work_reassigned_total") >= 1
    assert metric(server, "cloacina_delivery_outbox_open") == 0
    print(f"\nfailover (kill -9 → task finished on the survivor): {failover_s:.2f}s")


def test_a_late_result_from_an_evicted_agent_does_not_change_the_outcome(procs, tmp_path):
    key = cli_tenant_key(procs)
    akey = cli_agent_key(procs)
    server = fleet_serve(procs)
    upload(server, key, slow_package())
    agents = {name: start_agent(procs, server, akey, name) for name in ("w1", "w2")}
    marker = tmp_path / "slow-started"
    execution_id = start(server, key, "slow", {"marker": str(marker), "sleep_s": 4})
    wait_until(marker.exists, what="the first run started")
    victim = wait_until(lambda: execution(server, key, execution_id)["tasks"][0]["agent"])
    os.killpg(agents[victim].pid, signal.SIGSTOP)  # frozen: no heartbeats, the task pauses too
    try:
        body = wait_terminal(server, key, execution_id, timeout=30)
    finally:
        os.killpg(agents[victim].pid, signal.SIGCONT)
    assert body["context"]["who"] == "second"
    task = TaskExecution.objects.get(workflow_execution_id=execution_id)
    # The thawed agent finishes its run and reports "first": recorded, never applied.
    late = wait_until(
        lambda: TaskOutcome.objects.filter(task_execution=task, agent_name=victim).first(), timeout=30,
        what="the late outcome",
    )  # fmt: skip
    assert late.applied is False and late.ignored_reason  # e.g. "task is Completed, not Running"
    task.refresh_from_db()
    assert (task.status, task.output_context) == ("Completed", {"who": "second"})
    assert execution(server, key, execution_id)["context"]["who"] == "second"
    # …and the thawed agent notices it was declared dead and registers again.
    agents[victim].wait_for_output(re.compile(f"registered as {victim}"), 30)


def test_tenants_are_isolated(procs, tmp_path):
    key_a = cli_tenant_key(procs, "acme")
    key_b = cli_tenant_key(procs, "globex")
    agent_a, agent_b = cli_agent_key(procs, "acme"), cli_agent_key(procs, "globex")
    server = fleet_serve(procs)
    tasks = [{"id": f"q{i}", "function": "slowpkg.steps:quick"} for i in range(4)]
    pkg_a = upload(server, key_a, slow_package(tasks, name="fan-a", workflow="fan"))
    pkg_b = upload(server, key_b, slow_package(tasks, name="fan-b", workflow="fan"))
    start_agent(procs, server, agent_a, "a1", slots=2)
    start_agent(procs, server, agent_b, "b1", slots=2)
    ids_a = [start(server, key_a, "fan", {"n": i}) for i in range(3)]
    ids_b = [start(server, key_b, "fan", {"n": i}) for i in range(3)]
    for execution_id in ids_a:
        assert wait_terminal(server, key_a, execution_id)["status"] == "Completed"
    for execution_id in ids_b:
        assert wait_terminal(server, key_b, execution_id)["status"] == "Completed"
    ran_on = Counter(
        (t.tenant.name, t.agent.name)
        for t in TaskExecution.objects.select_related("tenant", "agent")
    )
    assert ran_on == {("acme", "a1"): 12, ("globex", "b1"): 12}
    assert not DeliveryOutbox.objects.exclude(tenant=models_tenant_of_agent()).exists()
    # An agent key of acme cannot fetch globex's artifact (nor see that it exists).
    theirs = httpx.get(
        server.api(f"/artifacts/{pkg_b['digest']}"), headers={"Authorization": f"Bearer {agent_a}"}
    )
    mine = httpx.get(
        server.api(f"/artifacts/{pkg_a['digest']}"), headers={"Authorization": f"Bearer {agent_a}"}
    )
    assert (theirs.status_code, mine.status_code) == (404, 200)


def models_tenant_of_agent():
    from django.db.models import F

    return F("agent__tenant")


def test_a_server_restart_with_tasks_in_flight_loses_and_repeats_nothing(procs, tmp_path):
    key = cli_tenant_key(procs)
    akey = cli_agent_key(procs)
    port = free_port()
    server = fleet_serve(procs, port=port, name="serve-first")
    tasks = [{"id": f"q{i}", "function": "slowpkg.steps:quick"} for i in range(3)]
    upload(server, key, slow_package(tasks, name="fan", workflow="fan"))
    start_agent(procs, server, akey, "w1", slots=3)
    start_agent(procs, server, akey, "w2", slots=3)
    ids = [start(server, key, "fan", {"n": i, "quick_s": 1.5}) for i in range(4)]
    wait_until(
        lambda: DeliveryOutbox.objects.filter(received_at__isnull=False).count() >= 4,
        what="work in the agents' hands",
    )
    server.process.kill_group()  # crash: no clean shutdown
    server = fleet_serve(procs, port=port, name="serve-second")
    for execution_id in ids:
        assert wait_terminal(server, key, execution_id, timeout=60)["status"] == "Completed"
    applied = Counter(
        TaskOutcome.objects.filter(applied=True).values_list("task_execution_id", flat=True)
    )
    assert len(applied) == 12 and set(applied.values()) == {1}  # each task completed exactly once
    assert set(TaskExecution.objects.values_list("status", flat=True)) == {"Completed"}


def test_two_servers_with_agents_on_either_execute_nothing_twice(procs, tmp_path):
    key = cli_tenant_key(procs)
    akey = cli_agent_key(procs)
    # Not a failover test: a generous liveness window, so a loaded machine evicts nobody.
    relaxed = {"CLOACINA_AGENT_HEARTBEAT_INTERVAL_S": "1", "CLOACINA_AGENT_LIVENESS_MISSES": "10"}
    first = fleet_serve(procs, **relaxed)
    second = fleet_serve(procs, **relaxed)
    tasks = [{"id": f"q{i}", "function": "slowpkg.steps:quick"} for i in range(5)]
    upload(first, key, slow_package(tasks, name="fan", workflow="fan"))
    start_agent(procs, first, akey, "on-first", slots=2)
    start_agent(procs, second, akey, "on-second", slots=2)
    ids = [
        start(first if i % 2 else second, key, "fan", {"n": i, "quick_s": 0.05}) for i in range(12)
    ]
    for execution_id in ids:
        assert wait_terminal(first, key, execution_id, timeout=60)["status"] == "Completed"
    runs = Counter(TaskOutcome.objects.values_list("task_execution_id", flat=True))
    twice = [
        list(
            TaskOutcome.objects.filter(task_execution_id=t).values_list(
                "assignment", "outcome", "applied", "agent_name", "ignored_reason", "error_message"
            )
        )
        for t, n in runs.items()
        if n > 1
    ]
    assert len(runs) == 60 and set(runs.values()) == {1}, (
        twice
    )  # one outcome per task: nobody ran twice
    rows = DeliveryOutbox.objects.all()
    assert rows.count() == 60 and set(rows.values_list("attempts", flat=True)) == {1}
    by_agent = Counter(rows.values_list("agent__name", flat=True))
    assert set(by_agent) == {"on-first", "on-second"}, by_agent
    assert not Eviction.objects.exists()
