"""A tenant's cron schedules: next fire times, the last outcomes, pause/resume and run now.

Changes go through :mod:`fleet.schedules.service`, the same code the REST API
calls, so the console and the API share one set of rules.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse

from fleet.api.error_status import http_status
from fleet.console.access import get_rw_tenant_for_user, get_tenant_for_user
from fleet.console.responses import ConsoleError, action_done, console_view
from fleet.models import Schedule, ScheduleFire, Tenant
from fleet.platform.cron import check_timezone
from fleet.platform.errors import DomainError
from fleet.schedules import service

OUTCOMES_SHOWN = 5
SCHEDULES_SHOWN = 500  # the page lists this many; GET /api/v1/schedules lists them all


@dataclass
class ScheduleRow:
    schedule: Schedule
    next_local: str  # the next fire time in the schedule's own timezone
    fires: list[ScheduleFire]  # the last few, newest first


def _local(schedule: Schedule) -> str:
    if not schedule.enabled or schedule.next_fire_at is None:
        return ""
    try:
        zone = check_timezone(schedule.timezone)
    except ValueError:
        return ""
    return schedule.next_fire_at.astimezone(zone).strftime("%Y-%m-%d %H:%M:%S %Z")


# Each schedule's newest fires through the (schedule, fire_time) unique index: a LATERAL
# subquery per schedule, so a schedule with a long history costs no more than a new one.
_RECENT_FIRES = """
SELECT f.* FROM fleet_schedule s CROSS JOIN LATERAL (
    SELECT * FROM fleet_schedulefire WHERE schedule_id = s.id
    ORDER BY fire_time DESC, id DESC LIMIT %s
) f
WHERE s.id = ANY(%s)
"""


def schedule_rows(tenant: Tenant) -> list[ScheduleRow]:
    """The tenant's first :data:`SCHEDULES_SHOWN` schedules, each with its last
    :data:`OUTCOMES_SHOWN` fires (two queries whatever the number of schedules)."""
    schedules = list(
        Schedule.objects.filter(tenant=tenant).order_by("workflow", "created_at", "id")[
            :SCHEDULES_SHOWN
        ]
    )
    recent: dict = {s.pk: [] for s in schedules}
    for fire in ScheduleFire.objects.raw(_RECENT_FIRES, [OUTCOMES_SHOWN, list(recent)]):
        recent[fire.schedule_id].append(fire)
    for fires in recent.values():
        fires.sort(key=lambda f: (f.fire_time, f.pk), reverse=True)
    return [ScheduleRow(s, _local(s), recent[s.pk]) for s in schedules]


def _context(request: HttpRequest, name: str) -> dict:
    tenant, can_write = get_tenant_for_user(request, name)
    return {
        "tenant": tenant,
        "can_write": can_write,
        "rows": schedule_rows(tenant),
        "total": Schedule.objects.filter(tenant=tenant).count(),
        "shown": SCHEDULES_SHOWN,
    }


@console_view()
def schedules(request: HttpRequest, name: str) -> HttpResponse:
    return render(request, "console/schedules.html", _context(request, name))


@console_view()
def schedules_table(request: HttpRequest, name: str) -> HttpResponse:
    return render(request, "console/partials/schedules_table.html", _context(request, name))


def _act(request: HttpRequest, name: str, schedule_id: uuid.UUID, action) -> HttpResponse:
    tenant = get_rw_tenant_for_user(request, name)
    try:
        message = action(tenant, schedule_id)
    except DomainError as exc:
        raise ConsoleError(exc.detail, http_status(exc)) from None
    return action_done(request, message, reverse("console:schedules", args=[tenant.name]))


@console_view(methods=["POST"])
def pause(request: HttpRequest, name: str, schedule_id: uuid.UUID) -> HttpResponse:
    def act(tenant: Tenant, pk: uuid.UUID) -> str:
        schedule = service.update_schedule(tenant, pk, {"enabled": False})
        return f"schedule {str(schedule.pk)[:8]} ({schedule.workflow}) paused"

    return _act(request, name, schedule_id, act)


@console_view(methods=["POST"])
def resume(request: HttpRequest, name: str, schedule_id: uuid.UUID) -> HttpResponse:
    def act(tenant: Tenant, pk: uuid.UUID) -> str:
        schedule = service.update_schedule(tenant, pk, {"enabled": True})
        return f"schedule {str(schedule.pk)[:8]} ({schedule.workflow}) resumed"

    return _act(request, name, schedule_id, act)


@console_view(methods=["POST"])
def run_now(request: HttpRequest, name: str, schedule_id: uuid.UUID) -> HttpResponse:
    def act(tenant: Tenant, pk: uuid.UUID) -> str:
        execution = service.run_now(tenant, pk)
        return f"execution {str(execution.pk)[:8]} started (manual run)"

    return _act(request, name, schedule_id, act)
