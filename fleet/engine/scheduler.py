"""The scheduler's state machine: start executions, advance them as tasks finish, cancel.

``advance`` runs with the workflow row locked (``SELECT … FOR UPDATE``), so
dependents of one execution are evaluated by one transaction at a time even
with several server processes applying results concurrently.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from django.db import connection, transaction
from django.utils import timezone

from artifacts.models import WorkflowPackage
from artifacts.store.queries import active_package, active_package_select
from fleet.engine import hooks
from fleet.engine.events import TaskReadyEvent
from fleet.models import (
    TASK_TERMINAL,
    WORKFLOW_TERMINAL,
    TaskExecution,
    TaskStatus,
    Tenant,
    TriggerRule,
    WorkflowExecution,
    WorkflowStatus,
)
from fleet.platform.errors import DomainError, ErrorKind


class SchedulingError(DomainError):
    """A request the scheduler refuses: an unknown workflow or execution, or a bad state."""


def start_execution(
    tenant: Tenant, workflow_name: str, context: dict, priority: int = 0
) -> WorkflowExecution:
    """Create an execution of the tenant's active package for ``workflow_name``; roots become Ready."""
    return start_execution_with_roots(tenant, workflow_name, context, priority)[0]


def start_execution_with_roots(
    tenant: Tenant,
    workflow_name: str,
    context: dict,
    priority: int = 0,
    package: WorkflowPackage | None = None,
) -> tuple[WorkflowExecution, list[TaskReadyEvent]]:
    """:func:`start_execution`, and the events of its root tasks (Ready from the start).

    ``package``, when the caller already looked up the active package, saves asking again.
    """
    if package is None:
        package = active_package(tenant, workflow_name)
    if package is None:
        raise SchedulingError(ErrorKind.NOT_FOUND, no_active_package(workflow_name))
    return start_executions([ExecutionStart(tenant, package, workflow_name, context, priority)])[0]


def no_active_package(workflow_name: str) -> str:
    """The 404's detail for a start of a workflow no active package provides."""
    return f"no active package provides workflow {workflow_name!r} in this tenant"


@dataclass(frozen=True)
class ExecutionStart:
    """One execution to create: of ``package`` (the active one for ``workflow_name``)."""

    tenant: Tenant
    package: WorkflowPackage
    workflow_name: str
    context: dict
    priority: int = 0


def start_executions(
    starts: list[ExecutionStart],
) -> list[tuple[WorkflowExecution, list[TaskReadyEvent]]]:
    """Create every execution of ``starts`` and their tasks in ONE statement (the schedule
    tick starts hundreds at once); each with the events of its root tasks."""
    now = timezone.now()
    started, rows = [], []
    for start in starts:
        tasks = start.package.manifest["tasks"]
        execution = WorkflowExecution(
            id=uuid.uuid4(),
            tenant=start.tenant,
            package=start.package,
            workflow_name=start.workflow_name,
            status=WorkflowStatus.PENDING,
            input_context=start.context,
            priority=start.priority,
            open_tasks=len(tasks),
            created_at=now,
        )
        task_rows = [
            {**_task_values(spec, position, start.priority), "workflow": str(execution.id)}
            for position, spec in enumerate(tasks)
        ]
        rows += task_rows
        roots = [
            TaskReadyEvent(
                row["id"], execution.id, row["task_name"], 1, start.tenant.pk, row["priority"]
            )
            for row in task_rows
            if row["root"]
        ]
        started.append((execution, roots))
    _insert_executions([execution for execution, _ in started], rows, now)
    return started


def _task_values(spec: dict, position: int, execution_priority: int) -> dict:
    """The manifest-derived columns of one task execution (the rest start at their defaults)."""
    return {
        "id": uuid.uuid4(),
        "task_name": spec["id"],
        "function": spec["function"],
        "dependencies": list(spec.get("dependencies") or []),
        "trigger_rule": spec.get("trigger_rule") or TriggerRule.ALL_SUCCESS,
        "position": position,
        "root": not spec.get("dependencies"),
        "max_retries": int(spec.get("retries") or 0),
        "retry_backoff_s": float(spec.get("retry_backoff_s") or 0.0),
        "timeout_s": float(spec.get("timeout_s") or 300.0),
        "routing": {k: spec[k] for k in ROUTING_KEYS if spec.get(k) not in (None, [], "")},
        "priority": int(spec.get("priority") or 0) + execution_priority,
    }


# Executions and their tasks in ONE statement (atomic on its own: no transaction
# round trips), the rows travelling as jsonb parameters.  The ORM's create +
# bulk_create prepared each of ~30 fields of each row in Python: a fifth of the
# server's CPU for starting an execution.  Every column is named, so a column added
# to a model must be added here too; tests/integration/test_engine_scheduler.py compares the lists.
WORKFLOW_INSERT_COLUMNS = (
    "id", "tenant_id", "package_id", "workflow_name", "status", "input_context",
    "final_context", "error", "priority", "open_tasks", "created_at", "started_at",
    "finished_at",
)  # fmt: skip
TASK_INSERT_COLUMNS = (
    "id", "workflow_execution_id", "tenant_id", "task_name", "function", "dependencies",
    "trigger_rule", "position", "status", "attempt", "max_retries", "retry_backoff_s",
    "timeout_s", "routing", "priority", "ready_at", "assignment", "claimed_by", "claimed_at",
    "started_at", "finished_at", "result_deadline", "agent_id", "refusals", "wait_reason",
    "output_context", "error_type", "error_message", "traceback",
)  # fmt: skip
_INSERT_EXECUTIONS = f"""
WITH executions AS (
    INSERT INTO fleet_workflowexecution ({", ".join(WORKFLOW_INSERT_COLUMNS)})
    SELECT e.id, e.tenant, e.package, e.name, 'Pending', e.input, NULL, '', e.priority, e.open,
        %(now)s, NULL, NULL
    FROM jsonb_to_recordset(%(executions)s::jsonb) AS e(
        id uuid, tenant bigint, package bigint, name text, input jsonb, priority int, open int)
)
INSERT INTO fleet_taskexecution ({", ".join(TASK_INSERT_COLUMNS)})
SELECT r.id, r.workflow, r.tenant, r.task_name, r.function, r.dependencies,
    r.trigger_rule, r.position, CASE WHEN r.root THEN 'Ready' ELSE 'NotStarted' END, 0,
    r.max_retries, r.retry_backoff_s, r.timeout_s, r.routing, r.priority,
    CASE WHEN r.root THEN %(now)s::timestamptz END, 0, '', NULL, NULL, NULL, NULL, NULL, 0, '',
    NULL, '', '', ''
FROM jsonb_to_recordset(%(rows)s::jsonb) AS r(
    id uuid, workflow uuid, tenant bigint, task_name text, function text, dependencies jsonb,
    trigger_rule text, position int, root boolean, max_retries int, retry_backoff_s float8,
    timeout_s float8, routing jsonb, priority int)
"""


def start_active(
    tenant_id: int, workflow_name: str, context: dict, priority: int = 0
) -> tuple[uuid.UUID, list[TaskReadyEvent]] | None:
    """Start ``workflow_name`` of the tenant's active package in ONE statement: the id of
    the new (Pending) execution and its root tasks' events, or None when no active package
    provides the workflow (nothing written).

    The REST start's path (``POST /workflows/{w}/executions`` without a backlog limit):
    the database reads the active package and expands its manifest's tasks itself, so a
    start is one round trip and no manifest travels to Python to be parsed, turned into
    rows and sent back as JSON (a third of the request's view, docs/performance.md,
    "Round i17-burst4").  The rows are those :func:`start_executions` writes, column for
    column (tests/integration/test_engine_scheduler.py compares the two)."""
    execution_id = uuid.uuid4()
    with connection.cursor() as cursor:
        cursor.execute(
            _START_ACTIVE,
            {
                "id": execution_id,
                "tenant": tenant_id,
                "workflow": workflow_name,
                "input": json.dumps(context),
                "priority": priority,
                "now": timezone.now(),
            },
        )
        rows = cursor.fetchall()
    if not rows:
        return None
    roots = [
        TaskReadyEvent(task_id, execution_id, task_name, 1, tenant_id, task_priority)
        for task_id, task_name, task_priority, ready in rows
        if ready
    ]
    return execution_id, roots


ROUTING_KEYS = (
    "agent", "tags", "capability", "min_free_memory_mb", "min_free_cpu_pct",
    "gpu", "min_free_vram_pct", "group", "affinity",
)  # fmt: skip


# _task_values in SQL, over the manifest's task list (validated at upload: artifacts/store/
# manifest.py).  Python's ``spec.get(k) or default`` is NULLIF/COALESCE here: a missing
# key and JSON null read as NULL; a timeout of 0, like a missing one, is the default.
_ROUTING_KEYS_SQL = "ARRAY[" + ", ".join(f"'{key}'" for key in ROUTING_KEYS) + "]::text[]"
_START_ACTIVE = f"""
WITH package AS ({active_package_select("id, manifest -> 'tasks' AS tasks", "%(tenant)s", "%(workflow)s")}),
specs AS (
    SELECT s.spec, s.n - 1 AS position,
        CASE WHEN jsonb_typeof(s.spec -> 'dependencies') = 'array'
            THEN s.spec -> 'dependencies' ELSE '[]'::jsonb END AS dependencies
    FROM package p, jsonb_array_elements(p.tasks) WITH ORDINALITY AS s(spec, n)
),
execution AS (
    INSERT INTO fleet_workflowexecution ({", ".join(WORKFLOW_INSERT_COLUMNS)})
    SELECT %(id)s, %(tenant)s, p.id, %(workflow)s, 'Pending', %(input)s::jsonb, NULL, '',
        %(priority)s, jsonb_array_length(p.tasks), %(now)s, NULL, NULL
    FROM package p
    RETURNING id
),
tasks AS (
    INSERT INTO fleet_taskexecution ({", ".join(TASK_INSERT_COLUMNS)})
    SELECT gen_random_uuid(), e.id, %(tenant)s, s.spec ->> 'id', s.spec ->> 'function',
        s.dependencies, COALESCE(NULLIF(s.spec ->> 'trigger_rule', ''), 'all_success'),
        s.position,
        CASE WHEN jsonb_array_length(s.dependencies) = 0 THEN 'Ready' ELSE 'NotStarted' END, 0,
        COALESCE((s.spec ->> 'retries')::int, 0),
        COALESCE((s.spec ->> 'retry_backoff_s')::float8, 0),
        COALESCE(NULLIF((s.spec ->> 'timeout_s')::float8, 0), 300),
        (SELECT COALESCE(jsonb_object_agg(k, s.spec -> k), '{{}}'::jsonb)
            FROM unnest({_ROUTING_KEYS_SQL}) AS k
            WHERE s.spec -> k NOT IN ('null'::jsonb, '[]'::jsonb, '""'::jsonb)),
        COALESCE((s.spec ->> 'priority')::int, 0) + %(priority)s,
        CASE WHEN jsonb_array_length(s.dependencies) = 0 THEN %(now)s::timestamptz END,
        0, '', NULL, NULL, NULL, NULL, NULL, 0, '', NULL, '', '', ''
    FROM specs s, execution e
    RETURNING id, task_name, priority, status = 'Ready'
)
SELECT t.* FROM execution e LEFT JOIN tasks t ON true
"""


def _insert_executions(executions: list[WorkflowExecution], rows: list[dict], now) -> None:
    """Write ``executions`` (built, unsaved) and their task rows (each naming its ``workflow``
    and, filled in here, its ``tenant``); the executions are then saved instances."""
    tenant_of = {str(e.id): e.tenant_id for e in executions}
    for row in rows:
        row["tenant"] = tenant_of[row["workflow"]]
    with connection.cursor() as cursor:
        cursor.execute(
            _INSERT_EXECUTIONS,
            {
                "executions": json.dumps(
                    [
                        {
                            "id": str(e.id),
                            "tenant": e.tenant_id,
                            "package": e.package_id,
                            "name": e.workflow_name,
                            "input": e.input_context,
                            "priority": e.priority,
                            "open": e.open_tasks,
                        }
                        for e in executions
                    ]
                ),
                "now": now,
                "rows": json.dumps(rows, default=str),
            },
        )
    for execution in executions:
        execution._state.adding = False  # as Model.save() leaves it
        execution._state.db = connection.alias


def unsaved_task_row(execution: WorkflowExecution, spec: dict, position: int, now) -> TaskExecution:
    """An unsaved TaskExecution for ``spec`` (tests build executions with it)."""
    values = _task_values(spec, position, execution.priority)
    root = values.pop("root")
    return TaskExecution(
        workflow_execution=execution,
        tenant_id=execution.tenant_id,
        status=TaskStatus.READY if root else TaskStatus.NOT_STARTED,
        ready_at=now if root else None,
        **values,
    )


def rule_outcome(rule: str, dependency_states: list[str]) -> str | None:
    """Ready, Skipped, or None (not decidable yet) for a task whose dependencies are in these states."""
    if not all(state in TASK_TERMINAL for state in dependency_states):
        return None
    if rule == TriggerRule.ALL_DONE:
        return TaskStatus.READY
    if rule == TriggerRule.ONE_FAILED:
        return TaskStatus.READY if TaskStatus.FAILED in dependency_states else TaskStatus.SKIPPED
    return (
        TaskStatus.READY
        if all(s == TaskStatus.COMPLETED for s in dependency_states)
        else TaskStatus.SKIPPED
    )


_LOCK_DEPENDENTS = """
SELECT id, task_name, trigger_rule, attempt, dependencies, tenant_id, priority FROM fleet_taskexecution
WHERE workflow_execution_id = %s AND status = 'NotStarted' AND dependencies ?| %s::text[]
ORDER BY id FOR UPDATE
"""
_DEPENDENCY_STATES = """
SELECT task_name, status FROM fleet_taskexecution
WHERE workflow_execution_id = %s AND task_name = ANY(%s::text[])
"""


def settle(task) -> tuple[list[TaskReadyEvent], int]:
    """Decide the dependents of ``task`` (a row with task_name and workflow_execution_id),
    which just reached a terminal state.

    Runs inside the outcome's transaction, after the task's own row was
    updated.  Each dependent row is locked before its dependencies' states are
    read (a later statement, so a fresh snapshot), so of two dependencies
    finishing at once the later transaction sees the earlier one committed and
    promotes the join exactly once.  Skips cascade.  Returns the events of tasks
    that became Ready and how many tasks were Skipped (they count as settled too).
    """
    workflow_id = task.workflow_execution_id
    events: list[TaskReadyEvent] = []
    skipped = 0
    frontier = [task.task_name]
    cancelled: bool | None = None
    with connection.cursor() as cursor:
        while frontier:
            cursor.execute(_LOCK_DEPENDENTS, [workflow_id, frontier])
            dependents = [
                (dep_id, name, rule, attempt, (tenant_id, priority), _json_list(deps))
                for dep_id, name, rule, attempt, deps, tenant_id, priority in cursor.fetchall()
            ]
            if not dependents:
                break
            if cancelled is None:
                cancelled = _is_cancelled(cursor, workflow_id)
            needed = sorted({d for *_, deps in dependents for d in deps})
            cursor.execute(_DEPENDENCY_STATES, [workflow_id, needed])
            states = dict(cursor.fetchall())
            ready_ids, skipped_ids, frontier = [], [], []
            for dependent_id, name, rule, attempt, (tenant_id, priority), deps in dependents:
                decided = (
                    TaskStatus.SKIPPED
                    if cancelled
                    else rule_outcome(rule, [states[d] for d in deps])
                )
                if decided == TaskStatus.READY:
                    ready_ids.append(dependent_id)
                    events.append(
                        TaskReadyEvent(
                            dependent_id, workflow_id, name, attempt + 1, tenant_id, priority
                        )
                    )
                elif decided == TaskStatus.SKIPPED:
                    skipped_ids.append(dependent_id)
                    frontier.append(name)
            _set_status(cursor, ready_ids, "Ready", "ready_at")
            _set_status(cursor, skipped_ids, "Skipped", "finished_at")
            skipped += len(skipped_ids)
    return events, skipped


def _set_status(cursor, task_execution_ids: list, status: str, stamp_column: str) -> None:
    if task_execution_ids:
        cursor.execute(
            f"UPDATE fleet_taskexecution SET status = %s, {stamp_column} = now() WHERE id = ANY(%s::uuid[])",
            [status, task_execution_ids],
        )


def _json_list(value) -> list:
    # Raw cursors hand jsonb back as text (Django decodes JSONField itself).
    return json.loads(value) if isinstance(value, str) else list(value or [])


def _is_cancelled(cursor, workflow_id) -> bool:
    cursor.execute("SELECT status FROM fleet_workflowexecution WHERE id = %s", [workflow_id])
    row = cursor.fetchone()
    return bool(row) and row[0] == WorkflowStatus.CANCELLED


def close_tasks(workflow_execution_id: uuid.UUID, count: int) -> None:
    """Count ``count`` more tasks as settled; the transaction that reaches zero finishes the workflow.

    The row lock this takes is held only from here to commit, at the very end of
    the outcome's transaction.
    """
    if count <= 0:
        return
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE fleet_workflowexecution SET open_tasks = GREATEST(open_tasks - %s, 0) "
            "WHERE id = %s RETURNING open_tasks, status",
            [count, workflow_execution_id],
        )
        row = cursor.fetchone()
    if row:
        finish_if_done(workflow_execution_id, *row)


def finish_if_done(workflow_execution_id: uuid.UUID, open_tasks: int, status: str) -> None:
    """Finish the workflow when its counter just reached zero (and nobody else finished it)."""
    if open_tasks == 0 and status not in WORKFLOW_TERMINAL:
        _finish(workflow_execution_id)


# Finish workflows in one statement: each Failed if any of its tasks failed (naming them, in
# code point order), else Completed; the final context is the input, then every completed
# task's output in manifest order (a later task's key wins, as in the context builder).
# One statement for every workflow a batch of outcomes finished.
_FINISH = """
WITH tasks AS (
    SELECT workflow_execution_id, task_name, status, output_context, position
    FROM fleet_taskexecution WHERE workflow_execution_id = ANY(%(workflows)s::uuid[])
), outcome AS (
    SELECT f.id,
        (SELECT array_agg(task_name ORDER BY task_name COLLATE "C") FROM tasks
         WHERE workflow_execution_id = f.id AND status = 'Failed') AS failed,
        (SELECT jsonb_object_agg(kv.key, kv.value ORDER BY t.position)
         FROM tasks t CROSS JOIN LATERAL jsonb_each(t.output_context) AS kv
         WHERE t.workflow_execution_id = f.id AND t.status = 'Completed'
           AND jsonb_typeof(t.output_context) = 'object') AS outputs
    FROM unnest(%(workflows)s::uuid[]) AS f(id)
)
UPDATE fleet_workflowexecution e SET
    status = CASE WHEN o.failed IS NULL THEN 'Completed' ELSE 'Failed' END,
    final_context = CASE WHEN jsonb_typeof(e.input_context) = 'object'
                         THEN e.input_context ELSE '{}'::jsonb END
                    || coalesce(o.outputs, '{}'::jsonb),
    finished_at = now(),
    error = CASE WHEN o.failed IS NULL THEN ''
                 ELSE 'task(s) failed: ' || array_to_string(o.failed, ', ') END
FROM outcome o
WHERE e.id = o.id AND e.status NOT IN ('Completed', 'Failed', 'Cancelled')
"""


def _finish(workflow_execution_id: uuid.UUID) -> None:
    finish_many([workflow_execution_id])


def finish_many(workflow_execution_ids: list[uuid.UUID]) -> None:
    """Finish these workflows (their open-task counters reached zero), in one statement;
    one already finished by someone else is left alone."""
    if workflow_execution_ids:
        with connection.cursor() as cursor:
            cursor.execute(_FINISH, {"workflows": sorted(set(workflow_execution_ids))})


def cancel_execution(tenant: Tenant, execution_id: uuid.UUID) -> WorkflowExecution:
    """Cancel: nothing new starts; tasks not yet running are Skipped; running ones finish on their own."""
    # No workflow row lock up front: outcome transactions lock task rows first and
    # the workflow row last (close_tasks), so taking it first here could deadlock.
    with transaction.atomic():
        execution = WorkflowExecution.objects.filter(tenant=tenant, pk=execution_id).first()
        if execution is None:
            raise SchedulingError(ErrorKind.NOT_FOUND, "execution not found")
        if execution.status in WORKFLOW_TERMINAL:
            raise SchedulingError(ErrorKind.CONFLICT, f"execution is already {execution.status}")
        now = timezone.now()
        skipped = TaskExecution.objects.filter(
            workflow_execution=execution, status__in=[TaskStatus.NOT_STARTED, TaskStatus.READY]
        ).update(
            status=TaskStatus.SKIPPED, finished_at=now, wait_reason="", error_message="cancelled"
        )
        skipped += hooks.withdraw_undelivered(execution.pk)  # the executor's undelivered work
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE fleet_workflowexecution SET status = %s, finished_at = now(), error = %s, "
                "open_tasks = GREATEST(open_tasks - %s, 0) WHERE id = %s AND status <> ALL(%s)",
                [
                    WorkflowStatus.CANCELLED,
                    "cancelled by request",
                    skipped,
                    execution.pk,
                    list(WORKFLOW_TERMINAL),
                ],
            )
            if cursor.rowcount != 1:
                raise SchedulingError(
                    ErrorKind.CONFLICT, "execution finished before it could be cancelled"
                )
    execution.refresh_from_db()
    return execution
