"""A task's log on the console: per attempt, beside its traceback, tailed while it runs.

The panel is one partial: the execution page loads it under the task graph when a task's
"log" link is clicked, the log page shows it alone, and while the attempt runs it polls
itself (htmx) until the attempt is over — the last render has no trigger.
"""

from __future__ import annotations

import uuid

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from fleet.console.access import get_execution_for_user
from fleet.console.responses import ConsoleError, console_view
from fleet.engine import task_logs
from fleet.models import TaskExecution, TaskOutcome, TaskStatus


def _attempt(request: HttpRequest, task: TaskExecution) -> int:
    """``?attempt=N`` (default the latest); 400 for one that is not a number, 404 for one
    that never ran."""
    raw = request.GET.get("attempt", "").strip()
    if not raw:
        return task.attempt
    if not raw.isdigit() or int(raw) < 1:
        raise ConsoleError(f"attempt must be a whole number from 1, got {raw[:40]!r}")
    attempt = int(raw)
    if attempt > task.attempt:
        raise Http404(f"task {task.task_name!r} has not run an attempt {attempt}")
    return attempt


def _outcome(task: TaskExecution, attempt: int) -> TaskOutcome | None:
    return (
        TaskOutcome.objects.filter(task_execution=task, attempt=attempt, applied=True)
        .order_by("-received_at")
        .first()
    )


def _context(request: HttpRequest, execution_id: uuid.UUID, task_name: str) -> dict:
    execution, _can_write = get_execution_for_user(request, execution_id)
    task = TaskExecution.objects.filter(workflow_execution=execution, task_name=task_name).first()
    if task is None:
        raise Http404(f"execution {str(execution.pk)[:8]} has no task {task_name!r}")
    attempt = _attempt(request, task) if task.attempt else 0
    entry = task_logs.attempt_log(task.pk, attempt) if attempt else None
    running = attempt == task.attempt and task.status == TaskStatus.RUNNING
    traceback = entry.traceback if entry is not None else ""
    if not traceback and attempt == task.attempt and task.status == TaskStatus.FAILED:
        traceback = task.traceback  # a failure recorded without a log row (e.g. lost run)
    return {
        "execution": execution,
        "task": task,
        "attempt": attempt,
        "attempts": range(task.attempt, 0, -1),
        "entry": entry,
        "text": task_logs.rendered(entry) if entry is not None else "",
        "traceback": traceback,
        "outcome": None if running or not attempt else _outcome(task, attempt),
        "running": running,
    }


@console_view()
def task_log(request: HttpRequest, execution_id: uuid.UUID, task_name: str) -> HttpResponse:
    return render(request, "console/task_log.html", _context(request, execution_id, task_name))


@console_view()
def task_log_panel(request: HttpRequest, execution_id: uuid.UUID, task_name: str) -> HttpResponse:
    return render(
        request, "console/partials/task_log.html", _context(request, execution_id, task_name)
    )
