"""Executions: a filterable list, and one execution's task graph laid out in dependency layers."""

from __future__ import annotations

import uuid

from django.core.paginator import Paginator
from django.db.models import Count, Prefetch, Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse

from fleet.api.error_status import http_status
from fleet.console import filters
from fleet.console.access import get_execution_for_user, tenants_for_user
from fleet.console.reruns import rerun_context
from fleet.console.responses import ConsoleError, action_done, console_view
from fleet.engine import scheduler
from fleet.models import (
    WORKFLOW_TERMINAL,
    TaskExecution,
    TaskOutcome,
    TaskStatus,
    WorkflowExecution,
    WorkflowStatus,
)

STATUSES = [s.value for s in WorkflowStatus]


def _list_context(request: HttpRequest) -> dict:
    tenant = filters.tenant_filter(request)
    status = filters.choice_filter(request, "status", STATUSES)
    visible = tenants_for_user(request.user)
    rows = WorkflowExecution.objects.select_related("tenant", "package").filter(tenant__in=visible)
    if tenant is not None:
        rows = rows.filter(tenant=tenant)
    if status:
        rows = rows.filter(status=status)
    rows = rows.annotate(
        n_tasks=Count("tasks"),
        n_done=Count("tasks", filter=Q(tasks__status=TaskStatus.COMPLETED)),
        n_failed=Count("tasks", filter=Q(tasks__status=TaskStatus.FAILED)),
        n_running=Count("tasks", filter=Q(tasks__status=TaskStatus.RUNNING)),
    ).order_by("-created_at", "-id")
    page = Paginator(rows, filters.PAGE_SIZE).get_page(filters.page_number(request))
    return {
        "page": page,
        "tenants": visible,
        "tenant": tenant,
        "status": status,
        "statuses": STATUSES,
        "query": filters.query_without_page(request),
        "full_query": request.GET.urlencode(),
    }


@console_view()
def executions(request: HttpRequest) -> HttpResponse:
    return render(request, "console/executions.html", _list_context(request))


@console_view()
def executions_table(request: HttpRequest) -> HttpResponse:
    return render(request, "console/partials/executions_table.html", _list_context(request))


def _depths(by_id: dict[str, TaskExecution]) -> dict[str, int]:
    """Each task's layer: 0 for a root, else one after its deepest dependency.

    Iterative (an explicit stack): a 2,000-task chain recursed past Python's limit and
    turned the execution page into a 500.  A dependency on the current path (a cycle, which
    manifests refuse anyway) is ignored, as is one that is not a task of this execution.
    """
    depth: dict[str, int] = {}
    on_path: set[str] = set()
    for root in by_id:
        if root in depth:
            continue
        stack = [root]
        while stack:
            task_name = stack[-1]
            if task_name in depth:  # pushed twice (two tasks depend on it): done already
                stack.pop()
                continue
            on_path.add(task_name)
            deps = [d for d in by_id[task_name].dependencies if d in by_id and d not in on_path]
            pending = [d for d in deps if d not in depth]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            on_path.discard(task_name)
            depth[task_name] = 1 + max((depth[d] for d in deps), default=-1)
    return depth


def dependency_layers(tasks: list[TaskExecution]) -> list[list[TaskExecution]]:
    """Tasks grouped by depth: roots first, each task one layer after its deepest dependency."""
    depth = _depths({t.task_name: t for t in tasks})
    layers: list[list[TaskExecution]] = []
    for task in sorted(tasks, key=lambda t: t.position):
        n = depth[task.task_name]
        while len(layers) <= n:
            layers.append([])
        layers[n].append(task)
    return layers


def _detail_context(request: HttpRequest, execution_id: uuid.UUID) -> dict:
    execution, can_write = get_execution_for_user(request, execution_id)
    tasks = list(
        TaskExecution.objects.filter(workflow_execution=execution)
        .select_related("agent")
        .prefetch_related(
            Prefetch("outcomes", queryset=TaskOutcome.objects.order_by("received_at", "id"))
        )
    )
    counts: dict[str, int] = {}
    for task in tasks:
        counts[task.status] = counts.get(task.status, 0) + 1
    return {
        "execution": execution,
        "can_write": can_write,
        "terminal": execution.status in WORKFLOW_TERMINAL,
        "layers": dependency_layers(tasks),
        "counts": sorted(counts.items()),
        **rerun_context(execution, can_write),
    }


@console_view()
def execution_detail(request: HttpRequest, execution_id: uuid.UUID) -> HttpResponse:
    return render(request, "console/execution.html", _detail_context(request, execution_id))


@console_view()
def execution_graph(request: HttpRequest, execution_id: uuid.UUID) -> HttpResponse:
    return render(
        request, "console/partials/execution_graph.html", _detail_context(request, execution_id)
    )


@console_view(methods=["POST"])
def cancel(request: HttpRequest, execution_id: uuid.UUID) -> HttpResponse:
    execution, can_write = get_execution_for_user(request, execution_id)
    if not can_write:
        raise ConsoleError(f"your role in tenant {execution.tenant.name!r} is read-only", 403)
    try:
        scheduler.cancel_execution(execution.tenant, execution.pk)
    except scheduler.SchedulingError as exc:
        raise ConsoleError(str(exc), http_status(exc)) from None
    return action_done(
        request,
        f"execution {str(execution.pk)[:8]} cancelled",
        reverse("console:execution", args=[execution.pk]),
    )
