"""Routing end to end: real `serve`, real `runagent` processes, real WebSockets, the
embedded PostgreSQL — large contexts by reference, selectors and exclusive agents,
drain with work in flight, and tenant fairness under a backlog."""

from __future__ import annotations

import hashlib
import re
import time

import httpx
import pytest
from django.utils import timezone

from agents.models import Agent
from artifacts.store.testing import build_archive, manifest_toml
from fleet.models import DeliveryOutbox, Eviction, TaskExecution, Tenant, WorkflowExecution
from tests.support.keys import cli_agent_key, cli_tenant_key
from tests.support.processes import Processes, fleet_serve, start_agent
from tests.support.server_api import execution, start, upload, wait_terminal
from tests.support.waiting import wait_until
from tests.support.workloads import SLOW_ONCE_SOURCE

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

ROUTED_SOURCE = """
import hashlib


def measure(context):
    blob = context["blob"]
    return {"n": len(blob), "sha": hashlib.sha256(blob.encode()).hexdigest()}


def plain(context):
    return {"plain": True}
"""


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


def package(tasks: list[dict], source: str, name: str, workflow: str) -> bytes:
    return build_archive(
        {
            "cloacina.toml": manifest_toml(tasks, name=name, workflow=workflow),
            "workflow/routed/__init__.py": "",
            "workflow/routed/steps.py": source,
        }
    )


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_selectors_exclusive_agents_and_a_context_too_large_for_a_frame(procs):
    key, akey = cli_tenant_key(procs), cli_agent_key(procs)
    server = fleet_serve(procs)
    tasks = [
        {"id": "measure", "function": "routed.steps:measure", "tags": ["big"]},
        {"id": "after1", "function": "routed.steps:plain", "dependencies": ["measure"]},
        {"id": "after2", "function": "routed.steps:plain", "dependencies": ["measure"]},
    ]
    upload(server, key, package(tasks, ROUTED_SOURCE, "routed", "routed"))
    nowhere = [{"id": "lost", "function": "routed.steps:plain", "tags": ["tpu"], "retries": 3}]
    upload(server, key, package(nowhere, ROUTED_SOURCE, "nowhere", "nowhere"))
    start_agent(procs, server, akey, "big", "--tags", "big,fast", "--max-concurrency", "2")
    vip = start_agent(procs, server, akey, "vip", "--exclusive", "--capabilities", "llama")
    assert Agent.objects.get(name="vip", state="live").exclusive is True
    assert Agent.objects.get(name="big", state="live").tags == ["big", "fast"]

    blob = 'x"\\' * 400_000  # 1.2 MB of text, ~2 MB as a JSON string: over one frame
    execution_id = start(server, key, "routed", {"blob": blob})
    body = wait_terminal(server, key, execution_id, timeout=60)
    assert body["status"] == "Completed", body
    assert body["context"]["n"] == len(blob)
    assert body["context"]["sha"] == hashlib.sha256(blob.encode()).hexdigest()
    # Tagged work on the tagged agent; untargeted work never on the exclusive one.
    assert {t["task_id"]: t["agent"] for t in body["tasks"]} == {
        "measure": "big", "after1": "big", "after2": "big",
    }  # fmt: skip
    packets = {
        r.task_execution.task_name: r.payload
        for r in DeliveryOutbox.objects.select_related("task_execution")
    }
    assert "context_json" not in packets["measure"]
    assert packets["measure"]["context_ref"]["bytes"] > 1024 * 1024
    assert "context_ref" in packets["after1"]  # the blob flows down to the dependents too
    assert vip.poll() is None  # registered, connected, given nothing

    # Nothing alive has the tag: the task fails at once, no retry, the API says why.
    failed = wait_terminal(server, key, start(server, key, "nowhere", {}), timeout=15)
    assert failed["status"] == "Failed"
    (task,) = failed["tasks"]
    assert task["attempt"] == 1
    assert task["error"].startswith(
        "NoMatchingAgent: none of the 2 live agent(s) of tenant acme matches tags [tpu]: "
    )


def test_a_drained_agent_finishes_its_work_then_exits_and_new_work_goes_elsewhere(procs, tmp_path):
    key, akey = cli_tenant_key(procs), cli_agent_key(procs)
    # Beats every 0.5 s as everywhere (the drain frame answers one), but a liveness window of
    # 5 s, not 1.5: the end state is the point here, and a CI machine starved for a second
    # and a half must not turn the clean exit into an eviction.
    server = fleet_serve(procs, CLOACINA_AGENT_LIVENESS_MISSES="10")
    tasks = [{"id": "slow", "function": "routed.steps:slow_once", "timeout_s": 60}]
    upload(server, key, package(tasks, SLOW_ONCE_SOURCE, "slow", "slow"))
    quick = [{"id": "q", "function": "routed.steps:quick"}]
    upload(server, key, package(quick, SLOW_ONCE_SOURCE, "quick", "quick"))
    agents = {name: start_agent(procs, server, akey, name) for name in ("w1", "w2")}
    marker = tmp_path / "slow-started"
    slow_id = start(server, key, "slow", {"marker": str(marker), "sleep_s": 3})
    wait_until(marker.exists, what="the slow run started")
    victim = wait_until(lambda: execution(server, key, slow_id)["tasks"][0]["agent"])
    other = ({"w1", "w2"} - {victim}).pop()
    fleet = httpx.get(server.api("/fleet"), headers=bearer(key), timeout=10).json()
    victim_id = next(a["id"] for a in fleet["agents"] if a["name"] == victim)
    assert next(a["health"] for a in fleet["agents"] if a["name"] == victim) == "healthy"

    drained = httpx.post(
        server.api(f"/agents/{victim_id}/drain"), json={"timeout_s": 30}, headers=bearer(key)
    )
    assert drained.status_code == 200, drained.text
    assert (drained.json()["state"], drained.json()["in_flight"]) == ("draining", 1)
    # New work goes to the other agent while the drained one finishes its task.
    quick_ids = [start(server, key, "quick", {"n": i}) for i in range(3)]
    for quick_id in quick_ids:
        done = wait_terminal(server, key, quick_id, timeout=30)
        assert done["status"] == "Completed" and done["tasks"][0]["agent"] == other
    slow = wait_terminal(server, key, slow_id, timeout=30)
    assert slow["status"] == "Completed"
    assert (slow["tasks"][0]["agent"], slow["tasks"][0]["attempt"]) == (victim, 1)
    assert slow["context"]["who"] == "first"  # it ran once, to the end, where it started
    # …then it was told to exit: it deregisters and stops with 0.
    deadline = time.monotonic() + 20
    while agents[victim].poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert agents[victim].poll() == 0, agents[victim].tail()
    assert "drained and deregistered" in agents[victim].output()
    evictions = list(Eviction.objects.filter(agent_name=victim).values_list("reason", flat=True))
    state = Agent.objects.get(name=victim).state
    # A clean exit, not a death (if not: why it died, and what the server said meanwhile).
    assert (state, evictions) == ("stopped", []), server.process.tail() + agents[victim].tail()
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert re.search(
        r'cloacina_agent_state_changes_total\{from="live",to="draining"\} [1-9]', metrics
    )
    assert re.search(
        r'cloacina_agent_state_changes_total\{from="draining",to="stopped"\} [1-9]', metrics
    )
    assert re.search(r"^cloacina_agents_connected 1\.0$", metrics, re.MULTILINE)


def _queue_executions(tenant: Tenant, workflow: str, count: int) -> None:
    """``count`` executions of a one-task workflow, committed at once (their roots Ready)."""
    from artifacts.store.services import active_package
    from fleet.engine.scheduler import unsaved_task_row

    package = active_package(tenant, workflow)
    spec = package.manifest["tasks"][0]
    now = timezone.now()
    executions = WorkflowExecution.objects.bulk_create(
        [
            WorkflowExecution(
                tenant=tenant,
                package=package,
                workflow_name=workflow,
                input_context={"n": i},
                open_tasks=1,
                created_at=now,
            )
            for i in range(count)
        ]  # fmt: skip
    )
    TaskExecution.objects.bulk_create([unsaved_task_row(e, spec, 0, now) for e in executions])


def test_one_tenants_backlog_does_not_starve_another(procs):
    """Tenant A has 1,000 tasks queued on a 2-worker server; tenant B's 10 arrive after and
    finish while most of A's still wait (dispatch takes the tenants in turn)."""
    key_a, key_b = cli_tenant_key(procs, "acme"), cli_tenant_key(procs, "globex")
    server = procs.serve(env=procs.env(CLOACINA_WORKER_PROCESSES="2"))
    tasks = [{"id": "q", "function": "routed.steps:quick"}]
    upload(server, key_a, package(tasks, SLOW_ONCE_SOURCE, "quick", "quick"))
    upload(server, key_b, package(tasks, SLOW_ONCE_SOURCE, "quick", "quick"))
    a = Tenant.objects.get(name="acme")
    _queue_executions(a, "quick", 1000)
    done_a = TaskExecution.objects.filter(tenant=a, status="Completed")
    wait_until(lambda: done_a.count() >= 10, timeout=60, what="tenant A's backlog under way")

    ids_b = [start(server, key_b, "quick", {"n": i}) for i in range(10)]
    for execution_id in ids_b:
        assert wait_terminal(server, key_b, execution_id, timeout=60)["status"] == "Completed"
    # From the rows: while each of B's tasks waited and ran, how much of A's went by?
    waits = []
    for ready_at, finished_at in TaskExecution.objects.filter(
        workflow_execution_id__in=ids_b
    ).values_list("ready_at", "finished_at"):
        a_meanwhile = done_a.filter(finished_at__gt=ready_at, finished_at__lte=finished_at)
        waits.append((a_meanwhile.count(), (finished_at - ready_at).total_seconds()))
    worst = max(waits)
    print(
        f"\nB's tasks, Ready → done: worst {worst[1]:.2f}s, while A finished {worst[0]}; "
        f"A done in all: {done_a.count()} of 1000"
    )
    # Taking turns, A runs about one task per B task waiting; without turns each of B's
    # tasks would queue behind all of A's remaining ~990.
    assert worst[0] < 60, f"A finished {worst[0]} tasks while one of B's waited"
