"""Cron schedules of workflows and every fire time they reached (fleet/schedules/)."""

from __future__ import annotations

import uuid

from django.db import models
from django.utils import timezone as django_time


class Catchup(models.TextChoices):
    """What a schedule does with fire times that passed while no server could fire them."""

    SKIP = "skip"  # record them as missed (the default)
    LATEST = "latest"  # run the most recent one, record the rest as missed
    ALL = "all"  # run every one (up to CLOACINA_SCHEDULE_CATCHUP_MAX), the rest missed


class Overlap(models.TextChoices):
    """What a fire does while the schedule's previous execution is unfinished."""

    ALLOW = "allow"
    SKIP = "skip"  # record skipped_overlap, start nothing
    CANCEL_PREVIOUS = "cancel_previous"  # cancel the unfinished execution(s), then start


class ScheduleSource(models.TextChoices):
    API = "api"
    PACKAGE = "package"  # declared by [[schedules]] in a package's cloacina.toml


class FireOutcome(models.TextChoices):
    STARTED = "started"
    SKIPPED_OVERLAP = "skipped_overlap"
    MISSED = "missed"
    FAILED_TO_START = "failed_to_start"
    MANUAL = "manual"


class Schedule(models.Model):
    """A cron schedule of one workflow in one tenant.

    ``next_fire_at`` is the next fire time not yet handled (UTC).  A firing tick
    claims due rows with ``FOR UPDATE SKIP LOCKED`` and, in one transaction,
    records each fire, starts its execution and advances ``next_fire_at``.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey("fleet.Tenant", on_delete=models.CASCADE, related_name="schedules")
    workflow = models.CharField(max_length=200)
    cron = models.CharField(max_length=120)
    timezone = models.CharField(max_length=64, default="UTC")
    context = models.JSONField(default=dict)
    enabled = models.BooleanField(default=True)
    catchup = models.CharField(max_length=8, choices=Catchup.choices, default=Catchup.SKIP)
    overlap = models.CharField(max_length=16, choices=Overlap.choices, default=Overlap.ALLOW)
    source = models.CharField(
        max_length=8, choices=ScheduleSource.choices, default=ScheduleSource.API
    )
    # For source=package: the package that declares it and the version that last did.
    package_name = models.CharField(max_length=100, blank=True, default="")
    package_version = models.CharField(max_length=64, blank=True, default="")
    next_fire_at = models.DateTimeField(null=True, blank=True)
    last_fire_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=django_time.now)
    updated_at = models.DateTimeField(default=django_time.now)

    class Meta:
        ordering = ["created_at", "id"]
        indexes = [
            models.Index(
                fields=["next_fire_at"],
                name="schedule_due",
                condition=models.Q(enabled=True),
            ),
            models.Index(fields=["tenant", "source", "package_name"], name="schedule_tenant"),
        ]

    def __str__(self) -> str:
        return f"{self.workflow} @ {self.cron} ({self.timezone})"


class ScheduleFire(models.Model):
    """One fire time of a schedule and what became of it; unique per (schedule, fire_time),
    so no fire time can ever get a second execution."""

    schedule = models.ForeignKey(Schedule, on_delete=models.CASCADE, related_name="fires")
    fire_time = models.DateTimeField()
    outcome = models.CharField(max_length=16, choices=FireOutcome.choices)
    execution = models.ForeignKey(
        "fleet.WorkflowExecution",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="schedule_fires",
    )
    detail = models.CharField(max_length=300, blank=True, default="")
    at = models.DateTimeField(default=django_time.now)

    class Meta:
        ordering = ["-fire_time", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["schedule", "fire_time"], name="schedule_fire_once")
        ]
