"""Control-plane records: audit of limit/desired_count changes, autoscaler decisions, depth samples."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class ChangeReason(models.TextChoices):
    MANUAL = "manual"  # tenant self-service provision/deprovision
    ADMIN = "admin"  # a platform admin's override
    AUTOSCALER = "autoscaler"
    CLAMP = "clamp"  # a lowered limit pulled desired_count down with it
    SEED = "seed"  # initial value at tenant creation


class FleetChange(models.Model):
    """Audit trail: who changed which fleet number of which tenant, from what to what, and why."""

    tenant = models.ForeignKey(
        "fleet.Tenant", on_delete=models.CASCADE, related_name="fleet_changes"
    )
    field = models.CharField(max_length=32)  # desired_count | max_agents_override
    old_value = models.IntegerField(null=True, blank=True)
    new_value = models.IntegerField(null=True, blank=True)
    reason = models.CharField(max_length=12, choices=ChangeReason.choices)
    actor = models.CharField(max_length=200)
    # Why, in words, when the reason alone does not say it (e.g. what lowered the limit).
    note = models.CharField(max_length=300, blank=True, default="")
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-at", "-id"]


class AutoscaleDecision(models.Model):
    tenant = models.ForeignKey(
        "fleet.Tenant", on_delete=models.CASCADE, related_name="autoscale_decisions"
    )
    pool = models.CharField(max_length=24, default="default")  # the agent pool it scaled
    at = models.DateTimeField(default=timezone.now)
    utilization = models.FloatField(null=True, blank=True)
    backlog = models.PositiveIntegerField(default=0)
    decision = models.CharField(max_length=8)  # up | down | hold
    old_desired = models.PositiveIntegerField()
    new_desired = models.PositiveIntegerField()
    reason = models.CharField(max_length=300)

    class Meta:
        ordering = ["-at", "-id"]


class OutboxDepthSample(models.Model):
    """Periodic outbox depth per tenant and state, for the console's depth-over-time chart."""

    tenant = models.ForeignKey(
        "fleet.Tenant", on_delete=models.CASCADE, related_name="outbox_samples"
    )
    at = models.DateTimeField(default=timezone.now, db_index=True)
    pending = models.PositiveIntegerField(default=0)
    delivered = models.PositiveIntegerField(default=0)
    oldest_pending_age_s = models.FloatField(default=0.0)

    class Meta:
        ordering = ["at"]
