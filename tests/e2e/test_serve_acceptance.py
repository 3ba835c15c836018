"""Acceptance: the real `serve` process, driven over HTTP and the real CLI.

* etl-demo end to end: upload, execute with a transient failure, retry, merged context.
* two servers on one database: every task runs exactly once.
"""

from __future__ import annotations

from collections import Counter

import pytest

from artifacts.store.testing import build_archive, example_archive, manifest_toml
from fleet.models import TaskExecution, TaskOutcome, WorkflowExecution
from tests.support.keys import cli_tenant_key
from tests.support.processes import Processes
from tests.support.server_api import start, upload, wait_terminal

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


def test_etl_demo_end_to_end_with_a_retry(procs, tmp_path):
    key = cli_tenant_key(procs)
    server = procs.serve()
    package = upload(server, key, example_archive("etl-demo"))
    assert package["tasks"] == ["extract", "transform_a", "transform_b", "load"]

    marker = tmp_path / "extract-failed-once"
    context = {"fail_once": True, "marker_path": str(marker)}
    body = wait_terminal(server, key, start(server, key, "etl", context))

    assert body["status"] == "Completed", [
        (t["task_id"], t["status"], t["error"]) for t in body["tasks"]
    ]
    assert body["context"] == {
        **context,
        "rows": [1, 2, 3],
        "sum": 6,
        "max": 3,
        "loaded": True,
        "report": "loaded 3 rows: sum=6 max=3",
    }
    tasks = {t["task_id"]: t for t in body["tasks"]}
    assert {name: t["status"] for name, t in tasks.items()} == dict.fromkeys(tasks, "Completed")
    assert tasks["extract"]["attempt"] == 2
    assert [tasks[n]["attempt"] for n in ("transform_a", "transform_b", "load")] == [1, 1, 1]
    assert all(t["agent"] is None for t in tasks.values())  # ran in-process
    assert marker.exists()
    outcomes = TaskOutcome.objects.filter(task_execution__task_name="extract").order_by(
        "received_at"
    )
    assert [(o.outcome, o.applied, o.error_type) for o in outcomes] == [
        ("failure", True, "TransientExtractError"),
        ("success", True, ""),
    ]


SIDE_EFFECT_TASKS = [
    {"id": "t1", "function": "side.steps:t1"},
    {"id": "t2", "function": "side.steps:t2", "dependencies": ["t1"]},
    {"id": "t3", "function": "side.steps:t3", "dependencies": ["t1"]},
    {"id": "t4", "function": "side.steps:t4", "dependencies": ["t2", "t3"]},
]
SIDE_EFFECT_SOURCE = """
import os


def _record(name, context):
    # One O_APPEND write per run: a task run twice shows up twice.
    with open(context["log"], "a") as fh:
        fh.write(f"{context['run']} {name} {os.getpid()}\\n")
    return {name: True}


def t1(context):
    return _record("t1", context)


def t2(context):
    return _record("t2", context)


def t3(context):
    return _record("t3", context)


def t4(context):
    return _record("t4", context)
"""


def side_effect_package() -> bytes:
    return build_archive(
        {
            "cloacina.toml": manifest_toml(SIDE_EFFECT_TASKS, name="side", workflow="side"),
            "workflow/side/__init__.py": "",
            "workflow/side/steps.py": SIDE_EFFECT_SOURCE,
        }
    )


def test_two_servers_on_one_database_run_every_task_exactly_once(procs, tmp_path):
    key = cli_tenant_key(procs)
    servers = [procs.serve(), procs.serve()]
    upload(servers[0], key, side_effect_package())
    log = tmp_path / "runs.log"
    runs = 30
    ids = [start(servers[i % 2], key, "side", {"log": str(log), "run": i}) for i in range(runs)]
    for execution_id in ids:
        assert wait_terminal(servers[0], key, execution_id)["status"] == "Completed"

    lines = [line.split() for line in log.read_text().splitlines()]
    per_task = Counter((run, name) for run, name, _ in lines)
    assert len(per_task) == runs * 4
    assert set(per_task.values()) == {1}, [k for k, v in per_task.items() if v > 1]
    applied = Counter(
        TaskOutcome.objects.filter(applied=True).values_list("task_execution_id", flat=True)
    )
    assert len(applied) == runs * 4 and set(applied.values()) == {1}
    assert not TaskOutcome.objects.filter(applied=False).exists()
    assert set(WorkflowExecution.objects.values_list("status", flat=True)) == {"Completed"}
    # Both servers took part (each is handed the executions it created on its fast path).
    claimers = set(TaskExecution.objects.values_list("claimed_by", flat=True))
    assert len(claimers) == 2, claimers
