"""Executions REST API: start, list, inspect and cancel workflow executions.

Every query is scoped by ``request.tenant``: another tenant's execution is a
404, exactly like one that does not exist.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

from django.http import HttpRequest, HttpResponse
from ninja import Field, Query, Router, Schema, Status
from ninja.errors import HttpError

from artifacts.models import WorkflowPackage
from artifacts.store.manifest import PRIORITY_LIMIT
from artifacts.store.queries import active_package
from fleet.api.execution_view import error_text, execution_view
from fleet.api.reruns import RerunLinkOut, RetryLinkOut, links_of
from fleet.engine import ready_queue, scheduler
from fleet.engine.context import ContextError, validate_context
from fleet.engine.scheduler import no_active_package
from fleet.executors.fleet.routing import fairness
from fleet.models import TaskExecution, Tenant, WorkflowExecution, WorkflowStatus
from fleet.platform.auth import read_auth, write_auth
from fleet.platform.config import get_config
from fleet.platform.errors import ErrorKind

router = Router(tags=["executions"])

# The two endpoints a user script calls for every execution (start it, poll it): the HTTP
# handler runs them, middleware and all, on a thread of the delivery database pool
# (cloacina_site/one_hop.py), which keeps its connection and prepares their statements,
# without Django's per-request thread and signal hops.  Those were a fifth of a start's
# server CPU (docs/performance.md, "Round i17-burst").
POOLED_VIEWS = frozenset({"api-v1:start_execution", "api-v1:get_execution"})

PAGE_MAX = 200
OFFSET_MAX = 1_000_000_000  # PostgreSQL's OFFSET is a bigint; past this there is nothing anyway


class ErrorOut(Schema):
    detail: str


class StartIn(Schema):
    context: dict[str, Any] = Field(
        default_factory=dict, description="the execution's input: a JSON object"
    )
    priority: int | None = Field(
        default=None,
        ge=-PRIORITY_LIMIT,
        le=PRIORITY_LIMIT,
        strict=True,
        description="added to every task's priority",
    )


class StartOut(Schema):
    id: uuid.UUID
    status: str


class TaskOut(Schema):
    task_id: str
    status: str
    attempt: int
    error: str | None = Field(description='"ErrorType: message", or null')
    agent: str | None = Field(description="name of the agent that ran it; null in-process")
    wait_reason: str
    started_at: datetime | None
    finished_at: datetime | None


class ExecutionOut(Schema):
    id: uuid.UUID
    workflow: str
    status: str
    context: dict | None = Field(description="the final merged context once terminal, else null")
    input_context: dict
    error: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    tasks: list[TaskOut]
    rerun_of: uuid.UUID | None = Field(description="the execution this one re-ran, or null")
    reruns: list[RerunLinkOut] = Field(description="executions re-run from this one")
    retries: list[RetryLinkOut] = Field(description="this execution's retries, oldest first")


class ExecutionSummary(Schema):
    id: uuid.UUID
    workflow: str
    status: str
    error: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class ExecutionPage(Schema):
    count: int
    limit: int
    offset: int
    items: list[ExecutionSummary]


class ListFilter(Schema):
    status: Literal["Pending", "Running", "Completed", "Failed", "Cancelled"] | None = Field(
        default=None, description="only executions in this status"
    )
    limit: int = Field(default=50, ge=1, le=PAGE_MAX)
    offset: int = Field(default=0, ge=0, le=OFFSET_MAX)


ERRORS = {401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 422: ErrorOut}

# What ninja's renderer sends for StartOut (json.dumps' default separators, its media type).
_STARTED_BODY = '{"id": "%s", "status": "%s"}'
_JSON = "application/json; charset=utf-8"


def started_response(execution_id: uuid.UUID) -> HttpResponse:
    """The 201 of a start, byte for byte what ninja renders from ``StartOut``, without
    its validation round (a response model built, dumped and JSON-encoded per request): a
    UUID and a constant need none.  It runs on the pool thread after the roots were
    handed to the dispatch loop, whose thread waits for the GIL until the response is
    done (docs/performance.md, "Round i17-start");
    tests/integration/test_rest_path.py compares the bytes with ninja's."""
    body = _STARTED_BODY % (execution_id, WorkflowStatus.PENDING)
    return HttpResponse(body, status=201, content_type=_JSON)


def _execution_for(tenant: Tenant, execution_id: uuid.UUID | str) -> WorkflowExecution:
    """The tenant's execution, or 404; ids that are not UUIDs are 422."""
    try:
        pk = execution_id if isinstance(execution_id, uuid.UUID) else uuid.UUID(execution_id)
    except ValueError:
        raise HttpError(422, f"{execution_id!r} is not an execution id (a UUID)") from None
    execution = WorkflowExecution.objects.filter(tenant=tenant, pk=pk).first()
    if execution is None:
        raise HttpError(404, f"execution {pk} not found")
    return execution


def _task_out(task: TaskExecution) -> dict:
    return {
        "task_id": task.task_name,  # the API keeps its published name (CONTRACT.md)
        "status": task.status,
        "attempt": task.attempt,
        "error": error_text(task.error_type, task.error_message),
        "agent": task.agent.name if task.agent_id else None,
        "wait_reason": task.wait_reason,
        "started_at": task.started_at,
        "finished_at": task.finished_at,
    }


def _execution_out(execution: WorkflowExecution) -> dict:
    tasks = TaskExecution.objects.filter(workflow_execution=execution).select_related("agent")
    terminal = execution.status in (
        WorkflowStatus.COMPLETED,
        WorkflowStatus.FAILED,
        WorkflowStatus.CANCELLED,
    )
    return {
        **_summary(execution),
        "context": execution.final_context if terminal else None,
        "input_context": execution.input_context,
        "tasks": [_task_out(t) for t in tasks],
        **links_of(execution),
    }


def _summary(execution: WorkflowExecution) -> dict:
    return {
        "id": execution.id,
        "workflow": execution.workflow_name,
        "status": execution.status,
        "error": execution.error or None,
        "created_at": execution.created_at,
        "started_at": execution.started_at,
        "finished_at": execution.finished_at,
    }


def _check_backlog(tenant: Tenant, workflow: str, package: WorkflowPackage | None) -> None:
    """429 when the execution would take the tenant past its backlog limit
    (:mod:`fleet.executors.fleet.routing.fairness`: the tenant's max_backlog, else the platform's)."""
    refusal = fairness.start_refusal(tenant, workflow, package)
    if refusal:
        raise HttpError(429, refusal)


@router.post(
    "/workflows/{workflow}/executions",
    auth=write_auth,
    response={201: StartOut, 429: ErrorOut, **ERRORS},
    summary="Start an execution of a workflow",
)
def start_execution(request: HttpRequest, workflow: str, body: StartIn):
    tenant = request.tenant
    try:
        context = validate_context(body.context, get_config().max_context_bytes)
    except ContextError as exc:
        raise HttpError(422, str(exc)) from None
    priority = body.priority or 0
    if not fairness.max_backlog(tenant)[0]:
        # No limit to check: the package is read and the execution written in one statement.
        started = scheduler.start_active(tenant.pk, workflow, context, priority)
        if started is None:
            raise scheduler.SchedulingError(ErrorKind.NOT_FOUND, no_active_package(workflow))
        execution_id, roots = started
        ready_queue.submit(roots)
        return started_response(execution_id)
    # Looked up once for the backlog check and the start (None: the start answers 404).
    package = active_package(tenant, workflow)
    _check_backlog(tenant, workflow, package)
    execution, roots = scheduler.start_execution_with_roots(
        tenant, workflow, context, priority=priority, package=package
    )
    ready_queue.submit(roots)
    return Status(201, {"id": execution.id, "status": execution.status})


@router.get(
    "/executions",
    auth=read_auth,
    response={200: ExecutionPage, **ERRORS},
    summary="List the tenant's executions, newest first",
)
def list_executions(request: HttpRequest, filters: Query[ListFilter]):
    executions = WorkflowExecution.objects.filter(tenant=request.tenant)
    if filters.status is not None:
        executions = executions.filter(status=filters.status)
    page = executions.order_by("-created_at", "-id")[
        filters.offset : filters.offset + filters.limit
    ]
    return {
        "count": executions.count(),
        "limit": filters.limit,
        "offset": filters.offset,
        "items": [_summary(e) for e in page],
    }


@router.get(
    "/executions/{execution_id}",
    auth=read_auth,
    response={200: ExecutionOut, **ERRORS},
    summary="An execution with its final context and per-task status",
)
def get_execution(request: HttpRequest, execution_id: uuid.UUID):
    # The path users poll: one statement (fleet/api/execution_view.py), not the ORM's two.
    view = execution_view(request.tenant.pk, execution_id)
    if view is None:
        raise HttpError(404, f"execution {execution_id} not found")
    return view


@router.post(
    "/executions/{execution_id}/cancel",
    auth=write_auth,
    response={200: ExecutionOut, 409: ErrorOut, **ERRORS},
    summary="Cancel an execution: nothing new starts, running tasks finish on their own",
)
def cancel_execution(request: HttpRequest, execution_id: uuid.UUID):
    execution = _execution_for(request.tenant, execution_id)
    execution = scheduler.cancel_execution(request.tenant, execution.pk)
    return _execution_out(execution)
