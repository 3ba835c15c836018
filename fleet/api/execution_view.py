"""``GET /executions/{id}`` in one statement: the execution, its tasks and their agents.

The REST path users poll.  Through the ORM it was two queries (the execution, then its tasks
with their agents) and compiling them cost more CPU than running them; here it is one
statement whose task list PostgreSQL assembles (``json_agg``), scoped by the tenant like
every other read.
"""

from __future__ import annotations

import uuid

from django.db import connection

from fleet.executors.fleet.state import ledger
from fleet.models import WORKFLOW_TERMINAL, TaskExecution, WorkflowExecution

TERMINAL = [str(status) for status in WORKFLOW_TERMINAL]
# ::json on the jsonb columns: Django has psycopg hand jsonb over as text (JSONField parses
# it); json is parsed by psycopg itself, like the json_agg of the tasks.
_EXECUTION_WITH_TASKS = f"""
SELECT e.id, e.workflow_name, e.status, e.error, e.created_at, e.started_at, e.finished_at,
       CASE WHEN e.status = ANY(%(terminal)s) THEN e.final_context::json END,
       e.input_context::json,
       COALESCE((
           SELECT json_agg(json_build_object(
                      'task_id', t.task_name, 'status', t.status, 'attempt', t.attempt,
                      'error_type', t.error_type, 'error_message', t.error_message,
                      'agent', a.name, 'wait_reason', t.wait_reason,
                      'started_at', t.started_at, 'finished_at', t.finished_at)
                  ORDER BY t.position)
           FROM {TaskExecution._meta.db_table} t
           LEFT JOIN {ledger.AGENTS} a ON a.id = t.agent_id
           WHERE t.workflow_execution_id = e.id
       ), '[]'::json)
FROM {WorkflowExecution._meta.db_table} e
WHERE e.tenant_id = %(tenant)s AND e.id = %(id)s
"""


def error_text(error_type: str, error_message: str) -> str | None:
    """A task's error as the API shows it: "ErrorType: message", the message alone, or null."""
    if not (error_type or error_message):
        return None
    return f"{error_type}: {error_message}" if error_type else error_message


def execution_view(tenant_id: int, execution_id: uuid.UUID) -> dict | None:
    """The execution as ``ExecutionOut`` describes it, or None when the tenant has no such one."""
    with connection.cursor() as cursor:
        cursor.execute(
            _EXECUTION_WITH_TASKS,
            {"terminal": TERMINAL, "tenant": tenant_id, "id": execution_id},
        )
        row = cursor.fetchone()
    if row is None:
        return None
    pk, workflow, status, error, created, started, finished, context, input_context, tasks = row
    return {
        "id": pk,
        "workflow": workflow,
        "status": status,
        "error": error or None,
        "created_at": created,
        "started_at": started,
        "finished_at": finished,
        "context": context,
        "input_context": input_context,
        "tasks": [_task(task) for task in tasks],
    }


def _task(task: dict) -> dict:
    # Timestamps arrive as ISO text (json_build_object); the response schema parses them, so
    # the JSON a client reads is the same as from datetime columns.
    task["error"] = error_text(task.pop("error_type"), task.pop("error_message"))
    return task
