"""Schedules REST API: cron schedules of the tenant's workflows (docs/schedules.md).

Every query is scoped by ``request.tenant``: another tenant's schedule is a 404,
exactly like one that does not exist.  Bad input is a 422 naming the field, and
nothing changes.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

from django.http import HttpRequest
from ninja import Field, Query, Router, Schema, Status

from fleet.models import Schedule, ScheduleFire
from fleet.platform.auth import read_auth, write_auth
from fleet.platform.cron import MAX_EXPRESSION_CHARS, MAX_TIMEZONE_CHARS
from fleet.platform.errors import ErrorKind
from fleet.schedules import service
from fleet.schedules.service import ScheduleSpec

router = Router(tags=["schedules"])

FIRES_MAX = 500
CatchupName = Literal["skip", "latest", "all"]
OverlapName = Literal["allow", "skip", "cancel_previous"]


class ErrorOut(Schema):
    detail: str


ERRORS = {401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 422: ErrorOut}


class ScheduleIn(Schema):
    workflow: str = Field(min_length=1, max_length=service.MAX_WORKFLOW_CHARS)
    cron: str = Field(
        min_length=1,
        max_length=MAX_EXPRESSION_CHARS,
        description="5 fields (minute hour day month weekday), or 6 with seconds first",
    )
    timezone: str = Field(default="UTC", min_length=1, max_length=MAX_TIMEZONE_CHARS)
    context: dict[str, Any] = Field(default_factory=dict, description="each execution's input")
    enabled: bool = Field(default=True, strict=True)
    catchup: CatchupName = "skip"
    overlap: OverlapName = "allow"


class SchedulePatch(Schema):
    workflow: str | None = Field(default=None, min_length=1, max_length=service.MAX_WORKFLOW_CHARS)
    cron: str | None = Field(default=None, min_length=1, max_length=MAX_EXPRESSION_CHARS)
    timezone: str | None = Field(default=None, min_length=1, max_length=MAX_TIMEZONE_CHARS)
    context: dict[str, Any] | None = None
    enabled: bool | None = Field(default=None, strict=True)
    catchup: CatchupName | None = None
    overlap: OverlapName | None = None


class ScheduleOut(Schema):
    id: uuid.UUID
    workflow: str
    cron: str
    timezone: str
    context: dict
    enabled: bool
    catchup: str
    overlap: str
    source: str = Field(description="api, or package (declared by [[schedules]])")
    package: str | None = Field(description="the declaring package as name==version, else null")
    next_fire_at: datetime | None
    last_fire_at: datetime | None


class FireOut(Schema):
    fire_time: datetime
    outcome: str = Field(description="started, skipped_overlap, missed, failed_to_start or manual")
    execution_id: uuid.UUID | None
    detail: str


class RunOut(Schema):
    id: uuid.UUID = Field(description="the execution started")
    status: str


class FiresFilter(Schema):
    limit: int = Field(default=100, ge=1, le=FIRES_MAX)


def schedule_out(schedule: Schedule) -> dict:
    """The API's (and the console's) view of a schedule."""
    return {
        "id": schedule.id,
        "workflow": schedule.workflow,
        "cron": schedule.cron,
        "timezone": schedule.timezone,
        "context": schedule.context,
        "enabled": schedule.enabled,
        "catchup": schedule.catchup,
        "overlap": schedule.overlap,
        "source": schedule.source,
        "package": (
            f"{schedule.package_name}=={schedule.package_version}"
            if schedule.package_name
            else None
        ),
        "next_fire_at": schedule.next_fire_at if schedule.enabled else None,
        "last_fire_at": schedule.last_fire_at,
    }


@router.post(
    "/schedules",
    auth=write_auth,
    response={201: ScheduleOut, **ERRORS},
    summary="Create a cron schedule of a workflow",
)
def create_schedule(request: HttpRequest, body: ScheduleIn):
    schedule = service.create_schedule(request.tenant, ScheduleSpec(**body.dict()))
    return Status(201, schedule_out(schedule))


@router.get(
    "/schedules",
    auth=read_auth,
    response={200: list[ScheduleOut], **ERRORS},
    summary="The tenant's schedules (made through the API and declared by packages)",
)
def list_schedules(request: HttpRequest):
    return [schedule_out(s) for s in Schedule.objects.filter(tenant=request.tenant)]


@router.get(
    "/schedules/{schedule_id}",
    auth=read_auth,
    response={200: ScheduleOut, **ERRORS},
    summary="One schedule",
)
def get_schedule(request: HttpRequest, schedule_id: uuid.UUID):
    return schedule_out(service.get_schedule(request.tenant, schedule_id))


@router.patch(
    "/schedules/{schedule_id}",
    auth=write_auth,
    response={200: ScheduleOut, 409: ErrorOut, **ERRORS},
    summary='Change a schedule ({"enabled": false} pauses it)',
)
def update_schedule(request: HttpRequest, schedule_id: uuid.UUID, body: SchedulePatch):
    changes = body.dict(exclude_unset=True)
    nulls = sorted(k for k, v in changes.items() if v is None)
    if nulls:
        raise service.ScheduleError(ErrorKind.INVALID, f"{', '.join(nulls)} may not be null")
    return schedule_out(service.update_schedule(request.tenant, schedule_id, changes))


@router.delete(
    "/schedules/{schedule_id}",
    auth=write_auth,
    response={204: None, 409: ErrorOut, **ERRORS},
    summary="Remove a schedule made through the API",
)
def delete_schedule(request: HttpRequest, schedule_id: uuid.UUID):
    service.delete_schedule(request.tenant, schedule_id)
    return Status(204, None)


@router.post(
    "/schedules/{schedule_id}/run",
    auth=write_auth,
    response={201: RunOut, 409: ErrorOut, 429: ErrorOut, **ERRORS},
    summary="Fire the schedule now (recorded as manual)",
)
def run_schedule(request: HttpRequest, schedule_id: uuid.UUID):
    execution = service.run_now(request.tenant, schedule_id)
    return Status(201, {"id": execution.id, "status": execution.status})


@router.get(
    "/schedules/{schedule_id}/fires",
    auth=read_auth,
    response={200: list[FireOut], **ERRORS},
    summary="The schedule's fire times, newest first, with outcome and execution",
)
def list_fires(request: HttpRequest, schedule_id: uuid.UUID, filters: Query[FiresFilter]):
    schedule = service.get_schedule(request.tenant, schedule_id)
    fires = ScheduleFire.objects.filter(schedule=schedule).order_by("-fire_time", "-id")
    return [
        {
            "fire_time": f.fire_time,
            "outcome": f.outcome,
            "execution_id": f.execution_id,
            "detail": f.detail,
        }
        for f in fires[: filters.limit]
    ]
