"""Starting an execution on a person's behalf: the rules POST /workflows/{workflow}/executions
applies (the context's checks, the tenant's backlog limit, the roots handed to the dispatch
loop after the commit), for the console's "start an execution" form."""

from __future__ import annotations

from typing import Any

from artifacts.store.queries import active_package
from fleet.engine import ready_queue, scheduler
from fleet.engine.context import ContextError, validate_context
from fleet.executors.fleet.routing import fairness
from fleet.models import Tenant, WorkflowExecution
from fleet.platform.config import get_config
from fleet.platform.errors import ErrorKind


def checked_context(context: Any) -> dict:
    """``context`` if it is a JSON object within the size limit; else a 422 naming why."""
    try:
        return validate_context(context, get_config().max_context_bytes)
    except ContextError as exc:
        raise scheduler.SchedulingError(ErrorKind.INVALID, str(exc)) from None


def start(tenant: Tenant, workflow: str, context: Any) -> WorkflowExecution:
    """Start ``workflow`` of the tenant's active package with ``context``; refusals are
    DomainErrors (404 unknown workflow, 422 bad context, 429 over the backlog)."""
    context = checked_context(context)
    package = active_package(tenant, workflow)  # once, for the backlog and the start
    refusal = fairness.start_refusal(tenant, workflow, package)
    if refusal:
        raise scheduler.SchedulingError(ErrorKind.LIMITED, refusal)
    execution, roots = scheduler.start_execution_with_roots(
        tenant, workflow, context, package=package
    )
    ready_queue.submit(roots)
    return execution
