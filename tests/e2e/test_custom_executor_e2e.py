"""A custom executor configured ONLY through config.toml: the real `serve` loads the example
executor (examples/executors/subprocess_limits.py) by its dotted path, runs workflows on it
(each task in a fresh, rlimited child) and reports it on /metrics."""

from __future__ import annotations

import re

import httpx
import pytest

from artifacts.store.testing import build_archive, example_archive, manifest_toml
from fleet.models import ServerInstance, TaskExecution
from tests.support.keys import cli_tenant_key
from tests.support.processes import Processes
from tests.support.server_api import start, upload, wait_terminal

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

MIB = 1024 * 1024
CONFIG_TOML = """
[server]
default_executor = "limited"

[executors.limited]
class = "examples.executors.subprocess_limits:SubprocessLimitsExecutor"
options = { workers = 2, cpu_seconds = 20, memory_mb = 256, open_files = 64 }
"""
PROBE_SOURCE = """
import os, resource

def _probe(name):
    return {
        name: {
            "pid": os.getpid(),
            "as": resource.getrlimit(resource.RLIMIT_AS)[0],
            "cpu": resource.getrlimit(resource.RLIMIT_CPU)[0],
            "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            "secret_in_env": any("CLOACINA" in name or name == "DATABASE_URL" for name in os.environ),
        }
    }

def first(context):
    return _probe("first")

def second(context):
    return _probe("second")

def hog(context):
    return {"bytes": len(bytearray(512 * 1024 * 1024))}
"""


def package(workflow: str, tasks: list[dict]) -> bytes:
    return build_archive(
        {
            "cloacina.toml": manifest_toml(tasks, name=workflow, workflow=workflow),
            "workflow/limits/__init__.py": "",
            "workflow/limits/steps.py": PROBE_SOURCE,
        }
    )


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        # No CLOACINA_DEFAULT_EXECUTOR or CLOACINA_EXECUTORS: config.toml alone decides.
        procs.extra_env = {"CLOACINA_DEFAULT_EXECUTOR": "", "CLOACINA_EXECUTORS": ""}
        yield procs


def sample(text: str, name: str, executor: str) -> float:
    match = re.search(rf'^{name}{{executor="{executor}"}} (\S+)$', text, re.MULTILINE)
    assert match, f"{name}{{executor={executor!r}}} not in /metrics"
    return float(match.group(1))


def test_workflows_run_on_the_example_executor_configured_in_config_toml(procs):
    (procs.home / "config.toml").write_text(CONFIG_TOML)
    key = cli_tenant_key(procs)
    server = procs.serve()
    assert "(executor: limited)" in server.process.output()

    # A real workflow (the etl-demo diamond, context merged across tasks) on the new executor.
    upload(server, key, example_archive("etl-demo"))
    etl = wait_terminal(server, key, start(server, key, "etl", {"input_rows": [2, 3]}))
    assert etl["status"] == "Completed", [(t["task_id"], t["error"]) for t in etl["tasks"]]
    assert etl["context"]["report"] == "loaded 2 rows: sum=5 max=3"

    # Each task in its own child, under the configured limits, without the server's secrets.
    upload(server, key, package("probe", [
        {"id": "first", "function": "limits.steps:first"},
        {"id": "second", "function": "limits.steps:second", "dependencies": ["first"]},
    ]))  # fmt: skip
    probe = wait_terminal(server, key, start(server, key, "probe", {}))
    assert probe["status"] == "Completed", [(t["task_id"], t["error"]) for t in probe["tasks"]]
    outputs = probe["context"]
    assert outputs["first"]["pid"] != outputs["second"]["pid"]
    for seen in outputs.values():
        assert (seen["as"], seen["cpu"], seen["nofile"]) == (256 * MIB, 20, 64)
        assert seen["secret_in_env"] is False

    # Past its memory limit a task fails (MemoryError), by its retry policy: no retries here.
    upload(server, key, package("hog", [{"id": "hog", "function": "limits.steps:hog"}]))
    hog = wait_terminal(server, key, start(server, key, "hog", {}))
    assert hog["status"] == "Failed"
    (task,) = hog["tasks"]
    assert (task["status"], task["attempt"]) == ("Failed", 1)
    assert "MemoryError" in str(task["error"])

    instance = ServerInstance.objects.get()
    assert instance.default_executor == "limited"
    assert set(TaskExecution.objects.values_list("claimed_by", flat=True)) == {instance.id}

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert sample(text, "cloacina_executor_selected", "limited") == 1
    assert sample(text, "cloacina_executor_selected", "default") == 0
    assert sample(text, "cloacina_executor_capacity", "limited") == 2
    assert sample(text, "cloacina_executor_tasks_executed_total", "limited") == 7
    assert sample(text, "cloacina_executor_tasks_failed_total", "limited") == 1
    assert sample(text, "cloacina_executor_tasks_executed_total", "default") == 0

    # A restart (which closes $CLOACINA_HOME again when root) still runs on it.
    assert server.process.stop() == 0
    server = procs.serve()
    again = wait_terminal(server, key, start(server, key, "probe", {}))
    assert again["status"] == "Completed", [(t["task_id"], t["error"]) for t in again["tasks"]]


def test_serve_refuses_a_config_toml_executor_that_is_not_one(procs):
    (procs.home / "config.toml").write_text(
        '[server]\ndefault_executor = "limited"\n\n'
        '[executors.limited]\nclass = "fleet.platform.config:Config"\n'
    )
    # A refusal comes after Django, daphne and twisted are imported: seconds, and more than
    # 30 once on a loaded 2-core CI machine. A server that starts instead never ends: the
    # timeout still catches that.
    result = procs.manage("serve", "--port", "0", timeout=90)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.strip() == (
        "CommandError: executor 'limited' ([executors.limited] in config.toml): "
        "fleet.platform.config:Config is not a TaskExecutor subclass "
        "(fleet.engine.executor.TaskExecutor)"
    )
    assert result.stdout == ""
    assert not ServerInstance.objects.exists()
