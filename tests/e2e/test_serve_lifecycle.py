"""`serve` process lifecycle: clean SIGTERM, and recovery of work a killed server held."""

from __future__ import annotations

import os
import signal

import pytest

from artifacts.store.testing import build_archive, manifest_toml
from fleet.models import ServerInstance, TaskExecution, TaskOutcome
from tests.support.keys import cli_tenant_key
from tests.support.processes import Processes
from tests.support.server_api import start, upload, wait_terminal
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


@pytest.mark.parametrize(
    "loop, sig",
    [
        ("", signal.SIGTERM),  # the default: uvloop (Twisted's asyncio reactor on it)
        ("", signal.SIGINT),
        ("asyncio", signal.SIGTERM),  # the fall-back: the standard library's loop
    ],
)
def test_sigterm_stops_cleanly_and_marks_the_instance_stopped(procs, loop, sig):
    server = procs.serve(env=procs.env(CLOACINA_EVENT_LOOP=loop))
    instance = ServerInstance.objects.get(pid=server.process.pid)
    assert instance.stopped_at is None and str(instance.port) in server.url
    assert f"event loop: {loop or 'uvloop'}" in server.process.output()
    server.process.signal(sig)
    assert server.process.popen.wait(20) == 0, server.process.tail()
    instance.refresh_from_db()
    assert instance.stopped_at is not None
    assert f"server {instance.id} stopped" in server.process.output()


SLOW_ONCE = """
import os
import time


def slow_once(context):
    # The first run hangs (its server is killed meanwhile); the rerun finds the marker.
    if not os.path.exists(context["marker"]):
        open(context["marker"], "w").close()
        time.sleep(60)
    return {"ran_in": os.getpid()}
"""


def test_work_of_a_killed_server_is_released_and_run_by_a_survivor(procs, tmp_path):
    key = cli_tenant_key(procs)
    servers = [procs.serve(), procs.serve()]
    tasks = [{"id": "slow", "function": "demo.steps:slow_once", "timeout_s": 120}]
    package = {
        "cloacina.toml": manifest_toml(tasks),
        "workflow/demo/__init__.py": "",
        "workflow/demo/steps.py": SLOW_ONCE,
    }
    upload(servers[0], key, build_archive(package))
    marker = tmp_path / "marker"
    execution_id = start(servers[0], key, "demo", {"marker": str(marker)})

    task = wait_until(
        lambda: TaskExecution.objects.filter(
            workflow_execution_id=execution_id, status="Running"
        ).first(),
        what="the task to be claimed",
    )
    wait_until(marker.exists, what="the first run to start")
    holder = ServerInstance.objects.get(pk=task.claimed_by)
    victim = next(s for s in servers if s.process.pid == holder.pid)
    survivor = next(s for s in servers if s is not victim)
    os.killpg(victim.process.pid, signal.SIGKILL)  # the server and its task children: no goodbye

    body = wait_terminal(survivor, key, execution_id, timeout=30)
    assert body["status"] == "Completed", body
    task.refresh_from_db()
    assert task.attempt == 1  # the released claim did not use up an attempt
    assert task.assignment == 2 and task.claimed_by != holder.id
    assert "stopped heartbeating" not in task.wait_reason  # cleared by the new claim
    holder.refresh_from_db()
    assert holder.stopped_at is not None
    assert list(TaskOutcome.objects.values_list("outcome", "applied")) == [("success", True)]
