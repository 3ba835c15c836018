"""``GET /executions/{id}/tasks/{task_name}/logs``: what one attempt of a task printed.

Plain text (``text/plain``), bounded by CLOACINA_TASK_LOG_BYTES and starting with a
``[… N bytes truncated …]`` line when its front was dropped; errors stay JSON.
Scoped like every execution endpoint: another tenant's execution is a 404, exactly
like one that does not exist.
"""

from __future__ import annotations

import uuid

from django.http import HttpRequest, HttpResponse
from ninja import Field, Query, Router, Schema
from ninja.errors import HttpError

from fleet.api.executions import ERRORS
from fleet.engine import task_logs
from fleet.models import TaskExecution, TaskStatus, Tenant, WorkflowExecution
from fleet.platform.auth import read_auth

router = Router(tags=["executions"])

ATTEMPT_MAX = 2**31 - 1  # fleet_taskexecution.attempt is an integer
# Response headers: which attempt this is and how much of its output the text holds.
HEADERS = {
    "X-Cloacina-Attempt": "the attempt shown",
    "X-Cloacina-Log-Bytes": "bytes the attempt wrote in all, kept or not",
    "X-Cloacina-Log-Truncated-Bytes": "bytes dropped from the front (0: the whole output)",
    "X-Cloacina-Log-Finished": "true once the attempt's outcome is in, false while it runs",
}
TEXT_RESPONSE = {
    "responses": {
        200: {
            "description": (
                "what the attempt printed (stdout, stderr, logging); bounded, and starting "
                "with a truncation line when its front was dropped"
            ),
            "content": {"text/plain": {"schema": {"type": "string"}}},
            "headers": {
                name: {"description": text, "schema": {"type": "string"}}
                for name, text in HEADERS.items()
            },
        }
    }
}


class LogQuery(Schema):
    attempt: int | None = Field(
        default=None,
        ge=1,
        le=ATTEMPT_MAX,
        description="which attempt (1 is the first run); default: the latest",
    )


def task_for(tenant: Tenant, execution_id: uuid.UUID, task_name: str) -> TaskExecution:
    """The tenant's task of that execution, or a 404 naming what is missing."""
    execution = WorkflowExecution.objects.filter(tenant=tenant, pk=execution_id).first()
    if execution is None:
        raise HttpError(404, f"execution {execution_id} not found")
    task = TaskExecution.objects.filter(workflow_execution=execution, task_name=task_name).first()
    if task is None:
        raise HttpError(404, f"execution {execution_id} has no task {task_name!r}")
    return task


def chosen_attempt(task: TaskExecution, attempt: int | None) -> int:
    """The attempt asked for, or the latest; a 404 for one that never ran."""
    if task.attempt < 1:
        raise HttpError(404, f"task {task.task_name!r} has not run yet (it is {task.status})")
    if attempt is None:
        return task.attempt
    if attempt > task.attempt:
        raise HttpError(
            404,
            f"task {task.task_name!r} has no attempt {attempt}: "
            f"it has run {task.attempt} attempt{'s' if task.attempt != 1 else ''}",
        )
    return attempt


@router.get(
    "/executions/{execution_id}/tasks/{task_name}/logs",
    auth=read_auth,
    response={**ERRORS},
    openapi_extra=TEXT_RESPONSE,
    summary="What one attempt of a task printed (text/plain, bounded, truncation marked)",
)
def task_log(request: HttpRequest, execution_id: uuid.UUID, task_name: str, query: Query[LogQuery]):
    task = task_for(request.tenant, execution_id, task_name)
    attempt = chosen_attempt(task, query.attempt)
    entry = task_logs.attempt_log(task.pk, attempt)
    running = task.attempt == attempt and task.status == TaskStatus.RUNNING
    response = HttpResponse(
        task_logs.rendered(entry) if entry is not None else "",
        content_type="text/plain; charset=utf-8",
    )
    response["X-Cloacina-Attempt"] = str(attempt)
    response["X-Cloacina-Log-Bytes"] = str(entry.bytes if entry else 0)
    response["X-Cloacina-Log-Truncated-Bytes"] = str(entry.truncated_bytes if entry else 0)
    response["X-Cloacina-Log-Finished"] = "false" if running else "true"
    return response
