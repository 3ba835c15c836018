"""``GET /executions/{id}`` in one statement: the execution, its tasks and their agents, and
its re-run and retry links.

The REST path users poll.  Through the ORM it was two queries (the execution, then its tasks
with their agents) and compiling them cost more CPU than running them; here it is one
statement, scoped by the tenant like every other read, whose answer PostgreSQL assembles.
"""

from __future__ import annotations

import uuid

from django.db import connection

from fleet.executors.fleet.state import ledger
from fleet.models import (
    WORKFLOW_TERMINAL,
    ExecutionLink,
    RerunKind,
    TaskExecution,
    WorkflowExecution,
)

TERMINAL = [str(status) for status in WORKFLOW_TERMINAL]
LINKS = ExecutionLink._meta.db_table
# The whole answer as one json value: psycopg parses it in one call (Python's json), where
# row columns would each go through a loader (Django's timestamptz loader is Python, and
# the jsonb columns arrive as text for JSONField to parse).  Timestamps become ISO text,
# which the response schema parses back, so clients read the same JSON as before.
_EXECUTION_WITH_TASKS = f"""
SELECT json_build_object(
    'id', e.id, 'workflow', e.workflow_name, 'status', e.status, 'error', NULLIF(e.error, ''),
    'created_at', e.created_at, 'started_at', e.started_at, 'finished_at', e.finished_at,
    'context', CASE WHEN e.status = ANY(%(terminal)s) THEN e.final_context END,
    'input_context', e.input_context,
    'tasks', COALESCE((
        SELECT json_agg(json_build_object(
                   'task_id', t.task_name, 'status', t.status, 'attempt', t.attempt,
                   'error_type', t.error_type, 'error_message', t.error_message,
                   'agent', a.name, 'wait_reason', t.wait_reason,
                   'started_at', t.started_at, 'finished_at', t.finished_at)
               ORDER BY t.position)
        FROM {TaskExecution._meta.db_table} t
        LEFT JOIN {ledger.AGENTS} a ON a.id = t.agent_id
        WHERE t.workflow_execution_id = e.id
    ), '[]'::json),
    -- Re-runs and retries (fleet/api/reruns.py: history): the re-run that made this one,
    -- the re-runs made from it, its retries; oldest first.
    'rerun_of', (
        SELECT l.source_id FROM {LINKS} l
        WHERE l.tenant_id = e.tenant_id AND l.execution_id = e.id AND l.kind <> %(retry)s
        ORDER BY l.at DESC, l.id DESC LIMIT 1),
    'reruns', COALESCE((
        SELECT json_agg(json_build_object(
                   'id', l.execution_id, 'actor', l.actor, 'at', l.at,
                   'context_edited', l.context_edited) ORDER BY l.at, l.id)
        FROM {LINKS} l
        WHERE l.tenant_id = e.tenant_id AND l.source_id = e.id AND l.execution_id <> e.id
          AND l.kind <> %(retry)s
    ), '[]'::json),
    'retries', COALESCE((
        SELECT json_agg(json_build_object(
                   'actor', l.actor, 'at', l.at, 'tasks', l.tasks,
                   'previous_error', l.previous_error) ORDER BY l.at, l.id)
        FROM {LINKS} l
        WHERE l.tenant_id = e.tenant_id AND l.kind = %(retry)s
          AND (l.source_id = e.id OR l.execution_id = e.id)
    ), '[]'::json))
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
            {
                "terminal": TERMINAL,
                "retry": str(RerunKind.RETRY),
                "tenant": tenant_id,
                "id": execution_id,
            },
        )
        row = cursor.fetchone()
    if row is None:
        return None
    view = row[0]
    for task in view["tasks"]:
        task["error"] = error_text(task.pop("error_type"), task.pop("error_message"))
    return view
