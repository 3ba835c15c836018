"""Control-plane records: audit of every limit change, autoscaler decisions, depth samples."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class ChangeReason(models.TextChoices):
    MANUAL = "manual"  # tenant self-service provision/deprovision
    ADMIN = "admin"  # a platform admin's override
    AUTOSCALER = "autoscaler"
    CLAMP = "clamp"  # a lowered limit pulled desired_count down with it
    SEED = "seed"  # initial value at tenant creation


# The free text a person may give with a manual change (FleetChange.note has room for it
# plus the cause of a clamp the change caused).
REASON_MAX_CHARS = 300
NOTE_MAX_CHARS = REASON_MAX_CHARS + 200


class FleetChange(models.Model):
    """Audit trail: who changed which limit of which tenant, from what to what, and why.

    ``field`` is one of :data:`AUDITED_FIELDS`; booleans are stored as 0/1.  ``reason`` is
    the kind of change (:class:`ChangeReason`); ``note`` is the why in words: the free-text
    reason the person gave (console, admin, REST), the cause of a clamp, or both.
    """

    tenant = models.ForeignKey(
        "fleet.Tenant", on_delete=models.CASCADE, related_name="fleet_changes"
    )
    field = models.CharField(max_length=32)  # one of AUDITED_FIELDS
    # Big: storage_quota_bytes is a byte count.
    old_value = models.BigIntegerField(null=True, blank=True)
    new_value = models.BigIntegerField(null=True, blank=True)
    reason = models.CharField(max_length=12, choices=ChangeReason.choices)
    actor = models.CharField(max_length=200)
    note = models.CharField(max_length=NOTE_MAX_CHARS, blank=True, default="")
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-at", "-id"]


# Every Tenant column that bounds what a tenant may run or store.
AUDITED_FIELDS = (
    "desired_count",
    "max_agents_override",
    "max_backlog",
    "is_active",
    "storage_quota_bytes",
)


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
