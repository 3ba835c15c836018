"""Re-run and retry end to end: a real `serve --default-executor fleet`, a real `runagent`,
real task code, the embedded PostgreSQL.

A task fails while something outside its input is missing (a flag file); the execution
fails; the flag appears; a retry runs only that task again, on the agent, and the
execution completes with the first task's output kept (it does not run twice).  Then a
re-run with an edited input is a new execution of the same version, linked both ways.
"""

from __future__ import annotations

import httpx
import pytest

from artifacts.store.testing import build_archive, manifest_toml
from fleet.models import TaskOutcome
from tests.support.keys import cli_agent_key, cli_tenant_key
from tests.support.processes import Processes, fleet_serve, start_agent
from tests.support.server_api import Api, upload, wait_terminal

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

GATED_SOURCE = """
from pathlib import Path


def fetch(context):
    return {"fetched": context.get("n", 1) * 10}


def publish(context):
    if not Path(context["flag"]).exists():
        raise RuntimeError("the upstream service is not ready (no flag file)")
    return {"published": context["fetched"] + 1}
"""


def gated_package() -> bytes:
    tasks = [
        {"id": "fetch", "function": "gated.steps:fetch"},
        {"id": "publish", "function": "gated.steps:publish", "dependencies": ["fetch"]},
    ]
    return build_archive(
        {
            "cloacina.toml": manifest_toml(tasks, name="gated", workflow="gated"),
            "workflow/gated/__init__.py": "",
            "workflow/gated/steps.py": GATED_SOURCE,
        }
    )


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


def test_retry_then_rerun_on_the_fleet(procs, tmp_path):
    key = cli_tenant_key(procs)
    server = fleet_serve(procs)
    start_agent(procs, server, cli_agent_key(procs), "w1", slots=2)
    upload(server, key, gated_package())
    api = Api(server, key)
    flag = tmp_path / "upstream-ready"

    first = api.start("gated", {"n": 4, "flag": str(flag)})
    failed = wait_terminal(server, key, first, timeout=60)
    assert failed["status"] == "Failed", failed
    tasks = {t["task_id"]: t for t in failed["tasks"]}
    assert tasks["publish"]["error"].startswith("RuntimeError: the upstream service is not ready")
    assert tasks["fetch"]["agent"] == "w1"

    # Retry before anything changed outside: it fails again, recorded as a retry.
    response = api.post(f"/executions/{first}/retry")
    assert response.status_code == 200, response.text
    assert response.json()["retried_tasks"] == ["publish"]
    again = wait_terminal(server, key, first, timeout=60)
    assert again["status"] == "Failed"

    # The flag appears: the next retry completes, fetch's output kept, fetch never re-run.
    flag.write_text("ready\n")
    assert api.post(f"/executions/{first}/retry").status_code == 200
    done = wait_terminal(server, key, first, timeout=60)
    assert done["status"] == "Completed", done
    assert done["context"] == {"n": 4, "flag": str(flag), "fetched": 40, "published": 41}
    attempts = {t["task_id"]: (t["attempt"], t["agent"]) for t in done["tasks"]}
    assert attempts == {"fetch": (1, "w1"), "publish": (3, "w1")}
    fetch_runs = TaskOutcome.objects.filter(
        task_execution__workflow_execution_id=first, task_execution__task_name="fetch"
    )
    assert fetch_runs.count() == 1
    assert [r["tasks"] for r in done["retries"]] == [["publish"], ["publish"]]
    assert api.post(f"/executions/{first}/retry").status_code == 409  # Completed now

    # A re-run with an edited input: a new execution of the same version, linked both ways.
    response = api.post(f"/executions/{first}/rerun", {"context": {"n": 5, "flag": str(flag)}})
    assert response.status_code == 201, response.text
    second = response.json()["id"]
    rerun = wait_terminal(server, key, second, timeout=60)
    assert rerun["status"] == "Completed"
    assert rerun["context"]["published"] == 51 and rerun["rerun_of"] == first
    original = httpx.get(server.api(f"/executions/{first}"), headers=api.headers, timeout=10)
    [link] = original.json()["reruns"]
    assert link["id"] == second and link["context_edited"] is True
    assert "Traceback" not in server.process.output(), server.process.tail(80)
