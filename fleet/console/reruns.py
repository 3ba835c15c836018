"""Re-run and retry from an execution's page, and the links between executions.

The buttons call :mod:`fleet.api.reruns`, the code behind the REST endpoints, so the
console and the API refuse the same requests with the same words.  Signed
``console:<user>`` in the history.
"""

from __future__ import annotations

import json
import uuid

from django.http import HttpRequest, HttpResponse
from django.urls import reverse

from fleet.api import reruns
from fleet.console.access import get_execution_for_user
from fleet.console.responses import (
    ConsoleError,
    action_done_go_to,
    console_view,
    refusals_answered,
)
from fleet.console.tenants import actor_of
from fleet.models import WORKFLOW_TERMINAL, WorkflowExecution, WorkflowStatus
from fleet.platform.config import get_config

EDITOR_MAX_CHARS = 200_000  # past this the editor shows the input read-only: edit over REST


def rerun_context(execution: WorkflowExecution, can_write: bool) -> dict:
    """What the execution page shows of re-runs and retries, and may offer."""
    origin, derived, retries = reruns.history(execution)
    text = json.dumps(execution.input_context, indent=2, sort_keys=True)
    return {
        "origin": origin,
        "reruns": derived,
        "retries": retries,
        "can_rerun": can_write,
        "can_retry": can_write and execution.status == WorkflowStatus.FAILED,
        "rerun_offered": execution.status in WORKFLOW_TERMINAL,
        "input_json": text,
        "input_editable": len(text) <= EDITOR_MAX_CHARS,
        "max_context_bytes": get_config().max_context_bytes,
    }


def parse_context(text: str) -> object:
    """The JSON of a context editor; 422 naming where it stops being JSON."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConsoleError(f"the context is not valid JSON: {exc}", 422) from None


def _writable(request: HttpRequest, execution_id: uuid.UUID) -> WorkflowExecution:
    execution, can_write = get_execution_for_user(request, execution_id)
    if not can_write:
        raise ConsoleError(f"your role in tenant {execution.tenant.name!r} is read-only", 403)
    return execution


@console_view(methods=["POST"])
def rerun(request: HttpRequest, execution_id: uuid.UUID) -> HttpResponse:
    """A new execution of the same package version, with the editor's context (the
    original's input when the editor was left empty); then its page."""
    execution = _writable(request, execution_id)
    text = request.POST.get("context", "").strip()
    context = parse_context(text) if text else None
    with refusals_answered():
        new = reruns.rerun(execution.tenant, execution.pk, actor_of(request), context)
    return action_done_go_to(
        request,
        f"execution {str(new.pk)[:8]} started: a re-run of {str(execution.pk)[:8]}",
        reverse("console:execution", args=[new.pk]),
    )


@console_view(methods=["POST"])
def retry(request: HttpRequest, execution_id: uuid.UUID) -> HttpResponse:
    """Re-open the Failed execution from its failed tasks; then its page again (live)."""
    execution = _writable(request, execution_id)
    with refusals_answered():
        retried = reruns.retry(execution.tenant, execution.pk, actor_of(request))
    return action_done_go_to(
        request,
        f"execution {str(execution.pk)[:8]} retried: {', '.join(retried.tasks)}",
        reverse("console:execution", args=[execution.pk]),
    )
