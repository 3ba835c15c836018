"""Re-run and retry over REST, and the rules the console shares with it.

``POST /executions/{id}/rerun`` starts a new execution of the same package version (201);
``POST /executions/{id}/retry`` re-opens a Failed execution from its failed tasks (200).
The engine's :mod:`fleet.engine.reruns` does the work and keeps the history; this module
adds what a request needs around it (the context's checks, the tenant's backlog limit,
who asked, handing Ready tasks to the dispatch loop after the commit), so the console's
buttons call :func:`rerun` and :func:`retry` here and answer exactly like the API.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from django.db.models import Q
from django.http import HttpRequest
from ninja import Field, Router, Schema, Status

from fleet.api.contract import optional_body, optional_body_doc
from fleet.api.fleet_status import actor_of
from fleet.api.starts import checked_context
from fleet.engine import ready_queue
from fleet.engine import reruns as engine
from fleet.executors.fleet.routing import fairness
from fleet.models import ExecutionLink, RerunKind, Tenant, WorkflowExecution
from fleet.platform.auth import write_auth

router = Router(tags=["executions"])


class ErrorOut(Schema):
    detail: str


class RerunIn(Schema):
    context: dict[str, Any] | None = Field(
        default=None,
        description="the new execution's input (a JSON object); omitted: the original's input",
    )


class RerunOut(Schema):
    id: uuid.UUID
    status: str
    rerun_of: uuid.UUID


class RetryOut(Schema):
    id: uuid.UUID
    status: str
    retried_tasks: list[str] = Field(description="the tasks re-opened, in manifest order")


class RerunLinkOut(Schema):
    id: uuid.UUID = Field(description="the execution the re-run started")
    actor: str
    at: datetime
    context_edited: bool


class RetryLinkOut(Schema):
    actor: str
    at: datetime
    tasks: list[str]
    previous_error: str


ERRORS = {401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 409: ErrorOut, 422: ErrorOut, 429: ErrorOut}


def _admission(tenant: Tenant) -> engine.Admission:
    return lambda adding: fairness.backlog_refusal(tenant, adding)


def rerun(
    tenant: Tenant, execution_id: uuid.UUID, actor: str, context: Any = None
) -> WorkflowExecution:
    """Re-run ``execution_id`` with ``context`` (None: its input); the roots go to the
    dispatch loop once committed.  Refusals are DomainErrors (404, 409, 422, 429)."""
    if context is not None:
        context = checked_context(context)
    execution, roots = engine.rerun_execution(
        tenant, execution_id, actor, context, admit=_admission(tenant)
    )
    ready_queue.submit(roots)
    return execution


def retry(tenant: Tenant, execution_id: uuid.UUID, actor: str) -> engine.Retried:
    """Retry a Failed ``execution_id`` from its failed tasks; its Ready tasks go to the
    dispatch loop once committed.  Refusals are DomainErrors (404, 409, 429)."""
    retried = engine.retry_execution(tenant, execution_id, actor, admit=_admission(tenant))
    ready_queue.submit(retried.ready)
    return retried


def history(
    execution: WorkflowExecution,
) -> tuple[ExecutionLink | None, list[ExecutionLink], list[ExecutionLink]]:
    """The execution's links, oldest first, in one query: the re-run that made it (or
    None), the re-runs made from it, and its retries."""
    origin, reruns, retries = None, [], []
    links = ExecutionLink.objects.filter(
        Q(source=execution) | Q(execution=execution), tenant_id=execution.tenant_id
    ).order_by("at", "id")
    for link in links:
        if link.kind == RerunKind.RETRY:
            retries.append(link)
        elif link.execution_id == execution.pk:
            origin = link
        else:
            reruns.append(link)
    return origin, reruns, retries


def links_of(execution: WorkflowExecution) -> dict:
    """What GET /executions/{id} shows of re-runs and retries (see :func:`history`)."""
    origin, reruns, retries = history(execution)
    return {
        "rerun_of": origin.source_id if origin else None,
        "reruns": [
            {
                "id": link.execution_id,
                "actor": link.actor,
                "at": link.at,
                "context_edited": link.context_edited,
            }
            for link in reruns
        ],  # fmt: skip
        "retries": [
            {
                "actor": link.actor,
                "at": link.at,
                "tasks": list(link.tasks),
                "previous_error": link.previous_error,
            }
            for link in retries
        ],  # fmt: skip
    }


@router.post(
    "/executions/{execution_id}/rerun",
    auth=write_auth,
    response={201: RerunOut, 400: ErrorOut, **ERRORS},
    summary="Re-run a finished execution: a new one of the same package version",
    openapi_extra=optional_body_doc(RerunIn),
)
def rerun_execution(request: HttpRequest, execution_id: uuid.UUID):
    """The same input context, or ``context`` when given (the body is optional). 409 while
    the execution is still Pending or Running."""
    body = optional_body(request, RerunIn)
    context = body.context if body is not None else None
    execution = rerun(request.tenant, execution_id, actor_of(request), context)
    return Status(201, {"id": execution.pk, "status": execution.status, "rerun_of": execution_id})


@router.post(
    "/executions/{execution_id}/retry",
    auth=write_auth,
    response={200: RetryOut, **ERRORS},
    summary="Retry a Failed execution from its failed tasks (completed ones keep their outputs)",
)
def retry_execution(request: HttpRequest, execution_id: uuid.UUID):
    """The same execution runs again: its failed tasks, and those skipped because of them,
    are decided again with a renewed retry budget. 409 unless the execution is Failed."""
    retried = retry(request.tenant, execution_id, actor_of(request))
    execution = retried.execution
    return {"id": execution.pk, "status": execution.status, "retried_tasks": retried.tasks}
