"""Test data: archives from a dict of files, published packages, executions and runs.

Packages are published through :func:`artifacts.store.services.publish_package`, the
same validation, build and blob store an upload goes through.
"""

from __future__ import annotations

import hashlib
import textwrap

from artifacts.store.testing import build_archive, example_archive, manifest_toml


def build_tar_gz(files: dict[str, str | bytes]) -> bytes:
    """A .tar.gz of ``files`` ({path: text or bytes}); text is dedented."""
    return build_archive(
        {k: v if isinstance(v, bytes) else textwrap.dedent(v) for k, v in files.items()}
    )


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_tenant(name: str = "acme"):
    from fleet.models import Tenant

    return Tenant.objects.get_or_create(name=name)[0]


def make_package(
    tenant,
    tasks: list[dict],
    source: str,
    *,
    name: str = "demo",
    workflow: str = "demo",
    version: str = "1.0.0",
    extra_files: dict[str, str | bytes] | None = None,
):
    """Publish a package whose module ``demo.steps`` (under workflow/) is ``source``.

    ``tasks`` are manifest task tables, e.g. ``{"id": "a", "function": "demo.steps:a"}``.
    """
    from artifacts.store.services import publish_package

    files: dict[str, str | bytes] = {
        "cloacina.toml": manifest_toml(tasks, name=name, workflow=workflow, version=version),
        "workflow/demo/__init__.py": "",
        "workflow/demo/steps.py": textwrap.dedent(source),
        **(extra_files or {}),
    }
    package, _created = publish_package(tenant, build_tar_gz(files))
    return package


def publish_example(tenant, name: str = "etl-demo"):
    """Publish ``examples/<name>`` for ``tenant``."""
    from artifacts.store.services import publish_package

    package, _created = publish_package(tenant, example_archive(name))
    return package


def start(tenant, workflow: str, context: dict | None = None):
    """Start an execution of ``workflow``; returns it with its tasks keyed by task id."""
    from fleet.engine.scheduler import start_execution

    execution = start_execution(tenant, workflow, context or {})
    return execution, tasks_of(execution)


def tasks_of(execution) -> dict:
    from fleet.models import TaskExecution

    return {t.task_name: t for t in TaskExecution.objects.filter(workflow_execution=execution)}


def finish(task, outcome: str = "success", output: dict | None = None, **report_fields):
    """Claim ``task`` (must be Ready and due) and apply one outcome for it; returns Applied."""
    from fleet.engine.claims import claim_task
    from fleet.engine.results import TaskReport, result_handler

    claim = claim_task(task.pk, "test")
    assert claim is not None, f"task {task.task_name} could not be claimed"
    return result_handler.apply(
        TaskReport(task.pk, claim.assignment, outcome, output=output, **report_fields)
    )


# --- fleet workflows: a two-task package and its Ready root ---------------------------------

NOOP_SOURCE = """
def a(context):
    return {"a": 1}

def b(context):
    return {"b": context.get("a", 0) + 1}
"""


def two_task_package(tenant, name: str = "demo", workflow: str = "demo", **task_extra):
    """Package ``demo``: root ``a`` (with ``task_extra`` keys) and ``b`` depending on it."""
    return make_package(
        tenant,
        [
            {"id": "a", "function": "demo.steps:a", **task_extra},
            {"id": "b", "function": "demo.steps:b", "dependencies": ["a"]},
        ],
        NOOP_SOURCE,
        name=name,
        workflow=workflow,
    )


def ready_root(tenant, context: dict | None = None, workflow: str = "demo"):
    """Start an execution; return (execution, its Ready root task ``a``)."""
    execution, tasks = start(tenant, workflow, context or {})
    return execution, tasks["a"]


def make_ready_tasks(tenant, n: int) -> None:
    """Start an execution of a workflow with ``n`` independent tasks: all ``n`` are Ready."""
    tasks = [{"id": f"t{i}", "function": "demo.steps:noop"} for i in range(n)]
    make_package(tenant, tasks, "def noop(ctx):\n    return None\n")
    execution, by_id = start(tenant, "demo")
    assert [t.status for t in by_id.values()] == ["Ready"] * n
