"""Hostile task outputs and outcomes: NaN, values JSON cannot hold, NUL characters, an
output that is not an object, a hostile agent posting such outputs itself, and the same
outcome posted many times at once.  A bad output fails its task with a clear error and
stores nothing of it; of concurrent copies of one outcome exactly one is applied.

Here: the end-to-end tests (real processes); the rest are in tests/integration/test_hostile_outputs.py.
"""

from __future__ import annotations

import pytest

from fleet.models import TaskExecution, TaskOutcome
from tests.support.factories import make_package

BAD_OUTPUTS = """
def nan(context):
    return {"x": float("nan")}

def infinity(context):
    return {"x": [1.0, float("-inf")]}

def a_set(context):
    return {"x": {1, 2}}

def nul(context):
    return {"x": "a\\x00b"}

def a_list(context):
    return [1, 2]

def fine(context):
    return {"fine": True}
"""

EXPECTED = {
    "nan": "task output is not valid JSON: Out of range float values",
    "infinity": "task output is not valid JSON: Out of range float values",
    "a_set": "task output is not JSON-serialisable: Object of type set",
    "nul": "task output holds a NUL character",
    "a_list": "task output must be a JSON object (dict) or None, got list",
}


@pytest.mark.e2e
def test_bad_outputs_fail_their_tasks_clearly_and_store_nothing(served):
    from tests.support.server_api import start, wait_terminal

    tasks = [{"id": name, "function": f"demo.steps:{name}"} for name in [*EXPECTED, "fine"]]
    make_package(served_tenant(), tasks, BAD_OUTPUTS, workflow="bad")
    execution_id = start(served.server, served.keys["write"], "bad", {})
    body = wait_terminal(served.server, served.keys["write"], execution_id, timeout=60)
    assert body["status"] == "Failed"
    by_id = {t["task_id"]: t for t in body["tasks"]}
    assert by_id["fine"]["status"] == "Completed"
    for name, words in EXPECTED.items():
        assert by_id[name]["status"] == "Failed", by_id[name]
        assert by_id[name]["error"].startswith("InvalidTaskOutput: "), by_id[name]
        assert words in by_id[name]["error"], by_id[name]
        row = TaskExecution.objects.get(workflow_execution_id=execution_id, task_name=name)
        assert row.output_context is None
        assert not TaskOutcome.objects.filter(task_execution=row, outcome="success").exists()
    served.assert_still_serving()


def served_tenant():
    from fleet.models import Tenant

    return Tenant.objects.get(name="acme")
