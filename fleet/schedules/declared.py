"""Schedules declared by a package's ``[[schedules]]`` (source ``package``).

When a package version becomes the active one, :func:`sync_declared` makes the
tenant's declared schedules of that package name match its manifest, inside the
publishing transaction: an entry with the same cron, timezone and context keeps its
row (its fire history and next fire time) and takes the new policies; entries no
longer declared are removed; new ones start counting from now.  Schedules made
through the API (source ``api``) are never touched.
"""

from __future__ import annotations

import json

from django.utils import timezone

from artifacts.models import WorkflowPackage
from fleet.models import Schedule, ScheduleSource
from fleet.platform.cron import parse_cron


def _identity(cron: str, zone: str, context: dict) -> tuple[str, str, str]:
    return cron, zone, json.dumps(context, sort_keys=True)


def sync_declared(package: WorkflowPackage) -> list[Schedule]:
    """Replace the package name's declared schedules with ``package``'s (skipped for a
    version that arrives already superseded by a newer one)."""
    if package.superseded:
        return []
    declared = package.manifest.get("schedules") or []
    existing = {
        _identity(s.cron, s.timezone, s.context): s
        for s in Schedule.objects.select_for_update().filter(
            tenant_id=package.tenant_id,
            source=ScheduleSource.PACKAGE,
            package_name=package.name,
        )
    }
    now = timezone.now()
    kept: list[Schedule] = []
    for entry in declared:
        schedule = existing.pop(_identity(entry["cron"], entry["timezone"], entry["context"]), None)
        resumed = schedule is not None and entry["enabled"] and not schedule.enabled
        if schedule is None:
            schedule = Schedule(
                tenant_id=package.tenant_id,
                source=ScheduleSource.PACKAGE,
                package_name=package.name,
                cron=entry["cron"],
                timezone=entry["timezone"],
                context=entry["context"],
                created_at=now,
            )
        if schedule._state.adding or resumed:
            schedule.next_fire_at = parse_cron(entry["cron"], entry["timezone"]).next_after(now)
        schedule.workflow = package.workflow_name
        schedule.enabled = entry["enabled"]
        schedule.catchup = entry["catchup"]
        schedule.overlap = entry["overlap"]
        schedule.package_version = package.version
        schedule.updated_at = now
        schedule.save()
        kept.append(schedule)
    if existing:
        Schedule.objects.filter(pk__in=[s.pk for s in existing.values()]).delete()
    return kept
