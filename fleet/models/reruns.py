"""Re-runs and retries of executions: who asked, when, and which executions they link.

One row per request.  A re-run links the execution it copied (``source``) to the new
execution it started (``execution``); a retry re-opens its execution in place, so both
point at the same one.  Written only by :mod:`fleet.engine.reruns`.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class RerunKind(models.TextChoices):
    RERUN = "rerun"  # a new execution of the same package version
    RETRY = "retry"  # the same execution, re-opened from its failed tasks


class ExecutionLink(models.Model):
    tenant = models.ForeignKey(
        "fleet.Tenant", on_delete=models.CASCADE, related_name="execution_links"
    )
    kind = models.CharField(max_length=5, choices=RerunKind.choices)
    source = models.ForeignKey(
        "fleet.WorkflowExecution", on_delete=models.CASCADE, related_name="derived_links"
    )
    execution = models.ForeignKey(
        "fleet.WorkflowExecution", on_delete=models.CASCADE, related_name="origin_links"
    )
    actor = models.CharField(max_length=200)  # "write key <lookup>" or "console:<user>"
    at = models.DateTimeField(default=timezone.now)
    # A re-run: whether the input context was edited (else it is the source's input).
    context_edited = models.BooleanField(default=False)
    # A retry: the tasks it re-opened and the error the execution had before.
    tasks = models.JSONField(default=list, blank=True)
    previous_error = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["at", "id"]
        indexes = [
            models.Index(fields=["source", "at"], name="link_source_idx"),
            models.Index(fields=["execution", "at"], name="link_execution_idx"),
        ]
