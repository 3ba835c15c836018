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
from django.utils import timezone

from fleet.api.error_status import http_status
from fleet.console.access import get_rw_tenant_for_user, get_tenant_for_user
from fleet.console.responses import ConsoleError, action_done, console_view
from fleet.models import Schedule, ScheduleFire, Tenant
from fleet.platform.cron import check_timezone
from fleet.platform.errors import DomainError
from fleet.schedules import service

OUTCOMES_SHOWN = 5


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


def schedule_rows(tenant: Tenant) -> list[ScheduleRow]:
    """The tenant's schedules, each with its last :data:`OUTCOMES_SHOWN` fires."""
    schedules = Schedule.objects.filter(tenant=tenant).order_by("workflow", "created_at")
    rows = []
    for schedule in schedules:
        fires = list(
            ScheduleFire.objects.filter(schedule=schedule).order_by("-fire_time", "-id")[
                :OUTCOMES_SHOWN
            ]
        )
        rows.append(ScheduleRow(schedule, _local(schedule), fires))
    return rows


def _context(request: HttpRequest, name: str) -> dict:
    tenant, can_write = get_tenant_for_user(request, name)
    return {
        "tenant": tenant,
        "can_write": can_write,
        "rows": schedule_rows(tenant),
        "now": timezone.now(),
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
