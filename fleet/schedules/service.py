"""Schedules made through the API: create, change, remove, run now.

Every function takes the caller's tenant and looks schedules up within it, so
another tenant's schedule is "not found" exactly like one that does not exist.
Bad input raises :class:`ScheduleError` (a DomainError naming the field) before
anything is written.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from fleet.engine import ready_queue, scheduler
from fleet.engine.context import ContextError, validate_context
from fleet.executors.fleet.routing import fairness
from fleet.models import (
    Catchup,
    FireOutcome,
    Overlap,
    Schedule,
    ScheduleFire,
    ScheduleSource,
    Tenant,
    WorkflowExecution,
)
from fleet.platform.config import get_config
from fleet.platform.cron import CronError, parse_cron
from fleet.platform.errors import DomainError, ErrorKind
from fleet.schedules import metrics

MAX_WORKFLOW_CHARS = 200
# What a PATCH may change; a package-declared schedule only pauses and resumes through the
# API (the rest comes from its cloacina.toml, and the next version would overwrite it).
EDITABLE = ("workflow", "cron", "timezone", "context", "enabled", "catchup", "overlap")
PACKAGE_EDITABLE = ("enabled",)


class ScheduleError(DomainError):
    """A schedule request refused: bad input, unknown schedule, or a declared schedule."""


@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule's settings, each checked (see :func:`check_spec`)."""

    workflow: str
    cron: str
    timezone: str = "UTC"
    context: dict | None = None
    enabled: bool = True
    catchup: str = Catchup.SKIP
    overlap: str = Overlap.ALLOW


def check_spec(spec: ScheduleSpec) -> ScheduleSpec:
    """``spec`` normalised, or :class:`ScheduleError` (INVALID) naming the bad field."""
    if not isinstance(spec.workflow, str) or not spec.workflow.strip():
        raise ScheduleError(ErrorKind.INVALID, "workflow must be a non-empty string")
    if len(spec.workflow) > MAX_WORKFLOW_CHARS or "\x00" in spec.workflow:
        raise ScheduleError(
            ErrorKind.INVALID,
            f"workflow must be at most {MAX_WORKFLOW_CHARS} characters, without NUL",
        )
    try:
        cron = parse_cron(spec.cron, spec.timezone)
    except CronError as exc:
        raise ScheduleError(ErrorKind.INVALID, str(exc)) from None
    if spec.catchup not in Catchup.values:
        raise ScheduleError(
            ErrorKind.INVALID,
            f"unknown catchup policy {spec.catchup!r} (one of {', '.join(Catchup.values)})",
        )
    if spec.overlap not in Overlap.values:
        raise ScheduleError(
            ErrorKind.INVALID,
            f"unknown overlap policy {spec.overlap!r} (one of {', '.join(Overlap.values)})",
        )
    if not isinstance(spec.enabled, bool):
        raise ScheduleError(ErrorKind.INVALID, "enabled must be true or false")
    try:
        context = validate_context(spec.context or {}, get_config().max_context_bytes)
    except ContextError as exc:
        raise ScheduleError(ErrorKind.INVALID, f"context: {exc}") from None
    return ScheduleSpec(
        spec.workflow, cron.expression, spec.timezone, context, spec.enabled, spec.catchup,
        spec.overlap,
    )  # fmt: skip


def next_fire(cron: str, zone: str, after: datetime | None = None) -> datetime | None:
    """The first fire time after ``after`` (default: now)."""
    return parse_cron(cron, zone).next_after(after or timezone.now())


def create_schedule(tenant: Tenant, spec: ScheduleSpec) -> Schedule:
    """A new API schedule; its first fire time is the first one after now."""
    spec = check_spec(spec)
    now = timezone.now()
    return Schedule.objects.create(
        tenant=tenant,
        workflow=spec.workflow,
        cron=spec.cron,
        timezone=spec.timezone,
        context=spec.context,
        enabled=spec.enabled,
        catchup=spec.catchup,
        overlap=spec.overlap,
        source=ScheduleSource.API,
        next_fire_at=next_fire(spec.cron, spec.timezone, now),
        created_at=now,
        updated_at=now,
    )


def get_schedule(tenant: Tenant, schedule_id: uuid.UUID | str, *, lock: bool = False) -> Schedule:
    """The tenant's schedule, or NOT_FOUND (also for another tenant's, or a non-UUID id)."""
    try:
        pk = schedule_id if isinstance(schedule_id, uuid.UUID) else uuid.UUID(str(schedule_id))
    except ValueError:
        raise ScheduleError(ErrorKind.NOT_FOUND, f"schedule {schedule_id!r} not found") from None
    rows = Schedule.objects.filter(tenant=tenant, pk=pk)
    schedule = (rows.select_for_update() if lock else rows).first()
    if schedule is None:
        raise ScheduleError(ErrorKind.NOT_FOUND, f"schedule {pk} not found")
    return schedule


def update_schedule(
    tenant: Tenant, schedule_id: uuid.UUID | str, changes: dict[str, Any]
) -> Schedule:
    """Apply ``changes`` (a subset of :data:`EDITABLE`).  A new expression or timezone, or
    a resume, starts counting fire times from now: paused time is not downtime."""
    unknown = sorted(set(changes) - set(EDITABLE))
    if unknown:
        raise ScheduleError(
            ErrorKind.INVALID, f"unknown field(s) {', '.join(unknown)} (allowed: {EDITABLE})"
        )
    with transaction.atomic():
        schedule = get_schedule(tenant, schedule_id, lock=True)
        if schedule.source == ScheduleSource.PACKAGE:
            fixed = sorted(set(changes) - set(PACKAGE_EDITABLE))
            if fixed:
                raise ScheduleError(
                    ErrorKind.CONFLICT,
                    f"schedule {schedule.pk} is declared by package {schedule.package_name}: "
                    f"change {', '.join(fixed)} in its cloacina.toml (the API may only "
                    "pause and resume it)",
                )
        current = ScheduleSpec(
            schedule.workflow, schedule.cron, schedule.timezone, schedule.context,
            schedule.enabled, schedule.catchup, schedule.overlap,
        )  # fmt: skip
        spec = check_spec(ScheduleSpec(**{**current.__dict__, **changes}))
        recount = (spec.cron, spec.timezone) != (schedule.cron, schedule.timezone) or (
            spec.enabled and not schedule.enabled
        )
        for name, value in spec.__dict__.items():
            setattr(schedule, name, value)
        now = timezone.now()
        if recount:
            schedule.next_fire_at = next_fire(spec.cron, spec.timezone, now)
        schedule.updated_at = now
        schedule.save()
    return schedule


def delete_schedule(tenant: Tenant, schedule_id: uuid.UUID | str) -> None:
    """Remove an API schedule and its fire history (its executions stay)."""
    with transaction.atomic():
        schedule = get_schedule(tenant, schedule_id, lock=True)
        if schedule.source == ScheduleSource.PACKAGE:
            raise ScheduleError(
                ErrorKind.CONFLICT,
                f"schedule {schedule.pk} is declared by package {schedule.package_name}: "
                "pause it, or remove it from the package's cloacina.toml and upload a new version",
            )
        schedule.delete()


def run_now(tenant: Tenant, schedule_id: uuid.UUID | str) -> WorkflowExecution:
    """Fire the schedule now, whatever its overlap policy or pause: an execution and a fire
    row with outcome ``manual`` and fire time now, in one transaction."""
    with transaction.atomic():
        schedule = get_schedule(tenant, schedule_id, lock=True)
        refusal = fairness.start_refusal(tenant, schedule.workflow)
        if refusal:
            raise ScheduleError(ErrorKind.LIMITED, refusal)
        execution, roots = scheduler.start_execution_with_roots(
            tenant, schedule.workflow, dict(schedule.context or {})
        )
        try:
            with transaction.atomic():
                ScheduleFire.objects.create(
                    schedule=schedule,
                    fire_time=execution.created_at,
                    outcome=FireOutcome.MANUAL,
                    execution=execution,
                    detail="run now",
                    at=execution.created_at,
                )
        except IntegrityError:  # a scheduled fire at this very microsecond: keep both apart
            raise ScheduleError(
                ErrorKind.CONFLICT, "the schedule fired at this instant; retry"
            ) from None
    metrics.FIRES.labels(FireOutcome.MANUAL).inc()
    ready_queue.submit(roots)
    return execution


def set_enabled(schedules: Iterable[Schedule], enabled: bool) -> int:
    """Pause or resume schedules of any tenant (the Django admin's actions); a resumed one
    counts its fire times from now, like a resume through the API.  Returns how many changed."""
    changed = 0
    for schedule in schedules:
        with transaction.atomic():
            row = Schedule.objects.select_for_update().filter(pk=schedule.pk).first()
            if row is None or row.enabled == enabled:
                continue
            now = timezone.now()
            row.enabled, row.updated_at = enabled, now
            if enabled:
                row.next_fire_at = next_fire(row.cron, row.timezone, now)
            row.save(update_fields=["enabled", "updated_at", "next_fire_at"])
            changed += 1
    return changed
