"""What each attempt of a task printed (docs/executors.md, "Task logs")."""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from fleet.models.executions import TaskExecution


class TaskAttemptLog(models.Model):
    """One attempt's output: its bounded tail, while it runs (live chunks) and once done.

    Written by :mod:`fleet.engine.task_logs` only: live chunks while the attempt runs
    (``finished`` false), then the whole tail with its outcome.  Rows older than
    CLOACINA_TASK_LOG_RETENTION_DAYS are pruned by the server's periodic job.
    """

    task_execution = models.ForeignKey(
        TaskExecution, on_delete=models.CASCADE, related_name="attempt_logs"
    )
    attempt = models.PositiveIntegerField()
    assignment = models.PositiveIntegerField()  # the claim that wrote it (fences live chunks)
    text = models.TextField(blank=True, default="")  # the kept tail, at most the ring's size
    bytes = models.BigIntegerField(default=0)  # everything the attempt wrote, kept or not
    truncated_bytes = models.BigIntegerField(default=0)  # dropped from the front of ``text``
    finished = models.BooleanField(default=False)  # the outcome's log, not a live tail
    traceback = models.TextField(blank=True, default="")  # a failed attempt's, beside its log
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["task_execution", "attempt"], name="one_log_per_task_attempt"
            ),
        ]

    @property
    def truncated(self) -> bool:
        return self.truncated_bytes > 0

    def __str__(self) -> str:
        return f"log of {self.task_execution_id} attempt {self.attempt}"
