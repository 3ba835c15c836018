"""Overflow protection and fairness between tenants.

Dispatch order (fleet/engine/fair_queue.py and ``claims.due_ready_task_events``):
tenants with waiting work take turns; within a tenant the higher priority goes
first, then the older work.  What this module adds is the bound on a tenant's
backlog: a tenant with more unfinished tasks (NotStarted, Ready, Running) than its
limit gets 429 on new executions.  The limit is the tenant's own ``max_backlog``
when set, else the platform's ``CLOACINA_MAX_BACKLOG``; 0 means unlimited.
"""

from __future__ import annotations

from django.db import connection

from artifacts.models import WorkflowPackage
from artifacts.store.queries import active_package
from fleet.models import TaskStatus, Tenant
from fleet.platform.config import get_config

UNFINISHED = [TaskStatus.NOT_STARTED, TaskStatus.READY, TaskStatus.RUNNING]
LOOK_UP = object()  # start_refusal's default: look the active package up itself


def max_backlog(tenant: Tenant) -> tuple[int, str]:
    """The tenant's backlog limit (0: none) and where it comes from, for messages."""
    if tenant.max_backlog:
        return tenant.max_backlog, "its max_backlog"
    platform = get_config().max_backlog
    return platform, "the platform's CLOACINA_MAX_BACKLOG"


def backlog(tenant: Tenant) -> int:
    """Tasks of the tenant not yet finished (NotStarted, Ready, Running)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM fleet_taskexecution WHERE tenant_id = %s AND status = ANY(%s)",
            [tenant.pk, UNFINISHED],
        )
        return cursor.fetchone()[0]


def backlog_refusal(tenant: Tenant, adding: int) -> str:
    """Why an execution of ``adding`` tasks must be refused now ('' when it fits)."""
    limit, source = max_backlog(tenant)
    if not limit:
        return ""
    current = backlog(tenant)
    if current + adding <= limit:
        return ""
    return (
        f"tenant {tenant.name!r} has {current} unfinished task(s); this execution adds "
        f"{adding}, over {source} of {limit}: retry later"
    )


def start_refusal(
    tenant: Tenant, workflow: str, package: WorkflowPackage | None | object = LOOK_UP
) -> str:
    """Why starting an execution of ``workflow`` (the tenant's active package) must be refused
    now ('' when it fits or the tenant has no limit): the API's 429, a schedule's run now.

    ``package``: the active package when the caller has already looked it up (None: there
    is none), so a start with a backlog limit asks for it once, not twice."""
    if not max_backlog(tenant)[0]:
        return ""
    if package is LOOK_UP:
        package = active_package(tenant, workflow)
    return backlog_refusal(tenant, len(package.task_names) if package else 0)
