"""Server processes and the installation they belong to: each `serve` registers itself and
heartbeats, so work claimed by a process that died (its in-process runs died with it) can be
recovered."""

from __future__ import annotations

import uuid

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


class Installation(models.Model):
    """This installation's identity: one row, made by the migration, never changed.

    Things outside the database that an installation owns (the docker actuator's
    containers) carry this id, so two installations sharing one Docker daemon never
    mistake each other's agents for those of a deleted tenant.
    """

    SINGLETON = 1

    key = models.PositiveSmallIntegerField(primary_key=True, default=SINGLETON)
    uid = models.UUIDField(default=uuid.uuid4, editable=False, unique=True)
    created_at = models.DateTimeField(default=timezone.now)

    @classmethod
    def current_id(cls) -> str:
        """The installation id (the row is created on first use if a restore dropped it)."""
        row, _created = cls.objects.get_or_create(key=cls.SINGLETON)
        return str(row.uid)
