"""The scheduler's state machine: trigger rules, cascading skips, finishing, cancel."""

from __future__ import annotations

import pytest

from fleet.api.error_status import http_status
from fleet.engine.events import ExecutionStatus
from fleet.engine.scheduler import SchedulingError, cancel_execution, rule_outcome
from fleet.models import TaskExecution, TaskOutcome, TaskStatus, WorkflowExecution, WorkflowStatus
from tests.support.factories import finish, make_package, start, tasks_of

SOURCE = "def f(ctx):\n    return {}\n"
pytestmark = pytest.mark.django_db


def task(task_name: str, deps: list[str] | None = None, rule: str | None = None, **extra) -> dict:
    spec = {"id": task_name, "function": "demo.steps:f", **extra}
    if deps:
        spec["dependencies"] = deps
    if rule:
        spec["trigger_rule"] = rule
    return spec


def statuses(execution) -> dict[str, str]:
    return {tid: t.status for tid, t in tasks_of(execution).items()}


def reload(execution) -> WorkflowExecution:
    return WorkflowExecution.objects.get(pk=execution.pk)


DIAMOND = [task("a"), task("b", ["a"]), task("c", ["a"]), task("d", ["b", "c"])]


@pytest.mark.parametrize(
    ("rule", "states", "expected"),
    [
        ("all_success", ["Completed", "Completed"], "Ready"),
        ("all_success", ["Completed", "Failed"], "Skipped"),
        ("all_success", ["Completed", "Skipped"], "Skipped"),
        ("all_success", ["Completed", "Running"], None),
        ("all_done", ["Failed", "Skipped"], "Ready"),
        ("all_done", ["Completed", "Ready"], None),
        ("one_failed", ["Completed", "Failed"], "Ready"),
        ("one_failed", ["Completed", "Skipped"], "Skipped"),
        ("one_failed", ["Failed", "NotStarted"], None),
    ],
)
def test_rule_outcome(rule, states, expected):
    assert rule_outcome(rule, states) == expected


def test_it_starts_with_only_the_roots_ready(tenant):
    make_package(tenant, DIAMOND, SOURCE)
    execution, tasks = start(tenant, "demo", {"x": 1})
    assert execution.status == WorkflowStatus.PENDING
    assert statuses(execution) == {
        "a": "Ready",
        "b": "NotStarted",
        "c": "NotStarted",
        "d": "NotStarted",
    }
    assert tasks["a"].ready_at is not None and tasks["b"].ready_at is None


def test_an_unknown_workflow_is_a_404(tenant):
    with pytest.raises(SchedulingError, match="no active package provides workflow 'nope'") as exc:
        start(tenant, "nope")
    assert http_status(exc.value) == 404
    assert not WorkflowExecution.objects.exists()


def test_all_success_diamond_completes_with_the_merged_final_context(tenant):
    make_package(tenant, DIAMOND, SOURCE)
    execution, tasks = start(tenant, "demo", {"input": 1, "k": "input"})
    applied = finish(tasks["a"], output={"a": 1, "k": "a"})
    assert {e.task_name for e in applied.ready} == {"b", "c"}
    assert reload(execution).status == WorkflowStatus.RUNNING
    assert finish(tasks["c"], output={"c": 3, "k": "c"}).ready == []  # d still waits for b
    applied = finish(tasks["b"], output={"b": 2, "k": "b"})
    assert [e.task_name for e in applied.ready] == ["d"]
    finish(tasks["d"], output=None)
    execution = reload(execution)
    assert execution.status == WorkflowStatus.COMPLETED
    assert execution.finished_at is not None and execution.error == ""
    # Input first, then every completed task's output in manifest order (c after b).
    assert execution.final_context == {"input": 1, "k": "c", "a": 1, "b": 2, "c": 3}


def test_a_failure_skips_its_all_success_dependents_in_cascade_and_fails_the_workflow(tenant):
    tasks_spec = [task("a"), task("b", ["a"]), task("c", ["b"]), task("other")]
    make_package(tenant, tasks_spec, SOURCE)
    execution, tasks = start(tenant, "demo", {"in": True})
    finish(tasks["other"], output={"other": 1})
    applied = finish(tasks["a"], "failure", error_type="ValueError", error_message="bad row")
    assert applied.status == ExecutionStatus.FAILED and applied.ready == []
    assert statuses(execution) == {
        "a": "Failed",
        "b": "Skipped",
        "c": "Skipped",
        "other": "Completed",
    }
    execution = reload(execution)
    assert execution.status == WorkflowStatus.FAILED
    assert execution.error == "task(s) failed: a"
    assert execution.final_context == {"in": True, "other": 1}
    failed = tasks_of(execution)["a"]
    assert (failed.error_type, failed.error_message) == ("ValueError", "bad row")


def test_all_done_runs_after_a_failed_dependency(tenant):
    make_package(tenant, [task("a"), task("cleanup", ["a"], "all_done")], SOURCE)
    execution, tasks = start(tenant, "demo")
    applied = finish(tasks["a"], "failure", error_type="E", error_message="x")
    assert [e.task_name for e in applied.ready] == ["cleanup"]
    finish(tasks["cleanup"], output={"cleaned": True})
    execution = reload(execution)
    # The cleanup ran, but a failed task still fails the workflow.
    assert execution.status == WorkflowStatus.FAILED
    assert execution.final_context == {"cleaned": True}


def test_all_done_runs_after_a_skipped_dependency(tenant):
    make_package(tenant, [task("a"), task("b", ["a"]), task("report", ["b"], "all_done")], SOURCE)
    execution, tasks = start(tenant, "demo")
    applied = finish(tasks["a"], "failure", error_type="E", error_message="x")
    assert [e.task_name for e in applied.ready] == ["report"]
    assert statuses(execution)["b"] == "Skipped"


def test_one_failed_runs_only_when_a_dependency_failed(tenant):
    spec = [task("a"), task("b"), task("alert", ["a", "b"], "one_failed"), task("after", ["alert"])]
    make_package(tenant, spec, SOURCE)
    execution, tasks = start(tenant, "demo")
    finish(tasks["a"], output={})
    applied = finish(tasks["b"], "failure", error_type="E", error_message="x")
    assert [e.task_name for e in applied.ready] == ["alert"]
    finish(tasks["alert"], output={"alerted": True})
    assert reload(execution).status == WorkflowStatus.RUNNING  # "after" is Ready now
    assert statuses(execution)["after"] == "Ready"


def test_one_failed_is_skipped_when_everything_succeeds_and_so_are_its_dependents(tenant):
    spec = [task("a"), task("alert", ["a"], "one_failed"), task("page", ["alert"])]
    make_package(tenant, spec, SOURCE)
    execution, tasks = start(tenant, "demo", {"i": 0})
    applied = finish(tasks["a"], output={"a": 1})
    assert applied.ready == []
    assert statuses(execution) == {"a": "Completed", "alert": "Skipped", "page": "Skipped"}
    execution = reload(execution)
    assert execution.status == WorkflowStatus.COMPLETED
    assert execution.final_context == {"i": 0, "a": 1}


def test_cancel_skips_what_has_not_started_and_lets_running_tasks_finish(tenant):
    make_package(tenant, [task("a"), task("r"), task("b", ["a"])], SOURCE)
    execution, tasks = start(tenant, "demo")
    from fleet.engine.claims import claim_task
    from fleet.engine.results import TaskReport, result_handler

    claim = claim_task(tasks["r"].pk, "test")  # r is running when the cancel arrives
    cancelled = cancel_execution(tenant, execution.pk)
    assert cancelled.status == WorkflowStatus.CANCELLED
    assert statuses(execution) == {"a": "Skipped", "r": "Running", "b": "Skipped"}
    # The running task's outcome is still recorded; the execution stays Cancelled.
    applied = result_handler.apply(TaskReport(tasks["r"].pk, claim.assignment, "success", {"r": 1}))
    assert applied.applied and applied.ready == []
    execution = reload(execution)
    assert execution.status == WorkflowStatus.CANCELLED
    assert execution.error == "cancelled by request"
    assert statuses(execution)["r"] == "Completed"


def test_a_failure_after_cancel_is_not_retried(tenant):
    make_package(tenant, [task("r", retries=3)], SOURCE)
    execution, tasks = start(tenant, "demo")
    from fleet.engine.claims import claim_task
    from fleet.engine.results import TaskReport, result_handler

    claim = claim_task(tasks["r"].pk, "test")
    cancel_execution(tenant, execution.pk)
    applied = result_handler.apply(
        TaskReport(tasks["r"].pk, claim.assignment, "failure", error_type="E", error_message="x")
    )
    assert applied.status == ExecutionStatus.FAILED
    assert statuses(execution) == {"r": "Failed"}
    assert reload(execution).status == WorkflowStatus.CANCELLED


def test_cancel_refuses_a_finished_execution_and_other_tenants(tenant, other_tenant):
    make_package(tenant, [task("a")], SOURCE)
    execution, tasks = start(tenant, "demo")
    with pytest.raises(SchedulingError, match="execution not found") as exc:
        cancel_execution(other_tenant, execution.pk)
    assert http_status(exc.value) == 404
    assert reload(execution).status == WorkflowStatus.PENDING
    finish(tasks["a"], output={})
    with pytest.raises(SchedulingError, match="already Completed") as exc:
        cancel_execution(tenant, execution.pk)
    assert http_status(exc.value) == 409


def test_every_outcome_is_recorded_once(tenant):
    make_package(tenant, DIAMOND, SOURCE)
    execution, tasks = start(tenant, "demo")
    for tid in ("a", "b", "c", "d"):
        finish(tasks[tid], output={tid: 1})
    outcomes = TaskOutcome.objects.filter(task_execution__workflow_execution=execution)
    assert outcomes.count() == 4
    assert all(o.applied and o.outcome == "success" and o.attempt == 1 for o in outcomes)
    assert set(statuses(execution).values()) == {TaskStatus.COMPLETED}


def test_the_execution_insert_names_every_column_of_both_models():
    from fleet.engine.scheduler import TASK_INSERT_COLUMNS, WORKFLOW_INSERT_COLUMNS
    from fleet.models import TaskExecution

    for model, listed in ((TaskExecution, TASK_INSERT_COLUMNS), (WorkflowExecution, WORKFLOW_INSERT_COLUMNS)):  # fmt: skip
        columns = {field.column for field in model._meta.concrete_fields}
        assert sorted(listed) == sorted(columns)


def test_started_tasks_carry_the_manifest_and_start_at_the_defaults(tenant):
    from fleet.engine.scheduler import start_execution_with_roots
    from fleet.models import TaskExecution

    make_package(
        tenant,
        [
            task("a", retries=2, retry_backoff_s=1.5, timeout_s=7, priority=3, tags=["gpu"]),
            task("b", ["a"], rule="all_done"),
        ],
        SOURCE,
    )
    execution, roots = start_execution_with_roots(tenant, "demo", {"k": 1}, priority=10)
    a = TaskExecution.objects.get(workflow_execution=execution, task_name="a")
    b = TaskExecution.objects.get(workflow_execution=execution, task_name="b")
    assert [(r.task_execution_id, r.task_name, r.attempt, r.priority) for r in roots] == [
        (a.id, "a", 1, 13)
    ]
    assert (a.status, a.position, a.max_retries, a.retry_backoff_s, a.timeout_s) == (
        TaskStatus.READY, 0, 2, 1.5, 7.0,
    )  # fmt: skip
    assert a.routing == {"tags": ["gpu"]} and a.priority == 13 and a.ready_at is not None
    assert (a.attempt, a.assignment, a.refusals, a.claimed_by, a.agent_id) == (0, 0, 0, "", None)
    assert (b.status, b.dependencies, b.trigger_rule, b.ready_at, b.priority) == (
        TaskStatus.NOT_STARTED, ["a"], "all_done", None, 10,
    )  # fmt: skip
    assert b.output_context is None and b.error_message == "" and b.timeout_s == 300.0
    stored = reload(execution)
    assert (stored.open_tasks, stored.input_context, stored.status) == (2, {"k": 1}, "Pending")
    assert (stored.priority, stored.workflow_name, stored.error) == (10, "demo", "")
    assert stored.created_at == execution.created_at and stored.final_context is None
    assert stored.tenant_id == tenant.pk and stored.package_id == execution.package_id
    execution.refresh_from_db()  # the returned instance is a saved one
    execution.save(update_fields=["priority"])


def test_a_failed_workflow_names_its_failed_tasks_in_code_point_order(tenant):
    make_package(tenant, [task("b"), task("B"), task("Z-1"), task("ok")], SOURCE)
    execution, tasks = start(tenant, "demo", {"in": 0})
    for name in ("b", "Z-1", "B"):
        finish(tasks[name], "failure", error_type="E", error_message="x")
    finish(tasks["ok"], output={"ok": 1, "in": 2})
    execution = reload(execution)
    assert execution.status == WorkflowStatus.FAILED
    assert execution.error == "task(s) failed: B, Z-1, b"
    assert execution.final_context == {"in": 2, "ok": 1}


# Every column a start writes, but the ones that differ between two starts by nature.
_ROW_FIELDS = [
    f.attname
    for f in TaskExecution._meta.concrete_fields
    if f.attname not in ("id", "workflow_execution_id", "ready_at")
]


def _rows_of(execution_id) -> list[tuple]:
    rows = TaskExecution.objects.filter(workflow_execution_id=execution_id).order_by("position")
    return [(*(getattr(t, f) for f in _ROW_FIELDS), t.ready_at is not None) for t in rows]


RICH = [
    task("a", retries=2, retry_backoff_s=1.5, timeout_s=7, priority=3, tags=["gpu", "x"]),
    task("b", ["a"], rule="all_done", agent="bench-1", capability="cuda"),
    task("c", ["a", "b"], rule="one_failed", min_free_memory_mb=512, min_free_cpu_pct=20),
    task("d", gpu=True, min_free_vram_pct=50.5, group="g", affinity="definition", priority=-4),
]
# A stored manifest from before normalisation: keys missing, null, empty, a zero timeout.
RAW = [
    {"id": "a", "function": "demo.steps:f", "retries": None, "timeout_s": 0, "tags": []},
    {"id": "b", "function": "demo.steps:f", "dependencies": None, "trigger_rule": "",
     "agent": "", "group": None, "priority": None, "retry_backoff_s": None},
    {"id": "c", "function": "demo.steps:f", "dependencies": ["a"], "gpu": False, "priority": 0},
]  # fmt: skip


@pytest.mark.parametrize("specs", [RICH, RAW], ids=["normalised", "raw"])
def test_the_one_statement_start_writes_what_the_python_start_writes(tenant, specs):
    from fleet.engine.scheduler import start_active, start_execution_with_roots

    package = make_package(tenant, RICH, SOURCE)
    if specs is RAW:
        package.manifest = {**package.manifest, "tasks": RAW}
        package.save(update_fields=["manifest"])
    execution, roots = start_execution_with_roots(tenant, "demo", {"k": [1]}, priority=10)
    execution_id, active_roots = start_active(tenant.pk, "demo", {"k": [1]}, priority=10)
    assert _rows_of(execution_id) == _rows_of(execution.id) and len(_rows_of(execution_id)) == len(specs)  # fmt: skip
    key = lambda r: (r.task_name, r.attempt, r.tenant_id, r.priority)  # noqa: E731
    assert sorted(map(key, active_roots)) == sorted(map(key, roots)) and active_roots
    assert {r.workflow_execution_id for r in active_roots} == {execution_id}
    ids = set(
        TaskExecution.objects.filter(
            workflow_execution_id=execution_id, status=TaskStatus.READY
        ).values_list("id", flat=True)
    )
    assert {r.task_execution_id for r in active_roots} == ids
    stored, python = reload_by_id(execution_id), reload(execution)
    fields = ("tenant_id", "package_id", "workflow_name", "status", "input_context",
              "final_context", "error", "priority", "open_tasks", "started_at", "finished_at")  # fmt: skip
    assert [getattr(stored, f) for f in fields] == [getattr(python, f) for f in fields]


def reload_by_id(execution_id) -> WorkflowExecution:
    return WorkflowExecution.objects.get(pk=execution_id)


def test_the_one_statement_start_takes_the_active_package_or_writes_nothing(tenant, other_tenant):
    from artifacts.store.queries import active_package
    from fleet.engine.scheduler import start_active

    make_package(tenant, [task("a")], SOURCE, version="1.0.0")
    newer = make_package(tenant, [task("a"), task("b")], SOURCE, version="2.0.0")
    execution_id, roots = start_active(tenant.pk, "demo", {})
    assert reload_by_id(execution_id).package_id == newer.pk and len(roots) == 2
    before = WorkflowExecution.objects.count()
    assert start_active(tenant.pk, "no_such_workflow", {}) is None
    assert start_active(other_tenant.pk, "demo", {}) is None  # another tenant's package
    newer.superseded = True  # as active_package decides: none of the tenant's is active now
    newer.save(update_fields=["superseded"])
    assert active_package(tenant, "demo") is None and start_active(tenant.pk, "demo", {}) is None
    assert WorkflowExecution.objects.count() == before
