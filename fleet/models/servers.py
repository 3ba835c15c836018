"""Server processes: each `serve` registers itself and heartbeats, so work claimed
by a process that died (its in-process runs died with it) can be recovered."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class ServerInstance(models.Model):
    id = models.CharField(
        max_length=100, primary_key=True
    )  # host:pid:random, unique per process start
    host = models.CharField(max_length=200)
    pid = models.PositiveIntegerField()
    port = models.PositiveIntegerField(null=True, blank=True)
    default_executor = models.CharField(max_length=50)
    started_at = models.DateTimeField(default=timezone.now)
    last_seen = models.DateTimeField(default=timezone.now, db_index=True)
    stopped_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-started_at"]
