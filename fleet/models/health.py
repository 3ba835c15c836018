"""Per-tenant health samples, one a minute, for the console's health-over-time charts."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class TenantHealthSample(models.Model):
    """What one sampling window said about one tenant (written by fleet/control/health_samples.py).

    ``completed`` and ``failed`` count tasks that reached that terminal state in the
    window (``window_s`` seconds ending at ``at``); the latencies are Ready→started of
    those tasks' last attempt (null when no task finished in the window).
    """

    tenant = models.ForeignKey(
        "fleet.Tenant", on_delete=models.CASCADE, related_name="health_samples"
    )
    at = models.DateTimeField(default=timezone.now, db_index=True)
    window_s = models.FloatField()
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    latency_p50_s = models.FloatField(null=True, blank=True)
    latency_p95_s = models.FloatField(null=True, blank=True)
    agents_live = models.PositiveIntegerField(default=0)
    desired_count = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["at"]
        indexes = [models.Index(fields=["tenant", "at"], name="health_sample_tenant_at")]
