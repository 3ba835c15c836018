"""Workflow executions, their task executions and every outcome ever reported."""

from __future__ import annotations

import uuid

from django.db import models
from django.utils import timezone


class WorkflowStatus(models.TextChoices):
    PENDING = "Pending"
    RUNNING = "Running"
    COMPLETED = "Completed"
    FAILED = "Failed"
    CANCELLED = "Cancelled"


WORKFLOW_TERMINAL = (WorkflowStatus.COMPLETED, WorkflowStatus.FAILED, WorkflowStatus.CANCELLED)


class TaskStatus(models.TextChoices):
    NOT_STARTED = "NotStarted"
    READY = "Ready"
    RUNNING = "Running"
    COMPLETED = "Completed"
    FAILED = "Failed"
    SKIPPED = "Skipped"


TASK_TERMINAL = (TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.SKIPPED)


class TriggerRule(models.TextChoices):
    ALL_SUCCESS = "all_success"
    ALL_DONE = "all_done"
    ONE_FAILED = "one_failed"


class WorkflowExecution(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # No index of its own: the (tenant, status, created_at) index leads with it.
    tenant = models.ForeignKey(
        "fleet.Tenant", on_delete=models.CASCADE, related_name="executions", db_index=False
    )
    package = models.ForeignKey(
        "artifacts.WorkflowPackage", on_delete=models.PROTECT, related_name="executions"
    )
    workflow_name = models.CharField(max_length=200)
    status = models.CharField(
        max_length=10, choices=WorkflowStatus.choices, default=WorkflowStatus.PENDING
    )
    input_context = models.JSONField(default=dict)
    final_context = models.JSONField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    priority = models.IntegerField(default=0)
    # Tasks not yet in a terminal state.  Decremented atomically as tasks settle,
    # so the transaction that takes it to zero finishes the workflow without
    # every outcome having to lock the workflow row for its whole transaction.
    open_tasks = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["tenant", "status", "created_at"])]


class TaskExecution(models.Model):
    """One task of one workflow execution.

    ``assignment`` is the fencing token: it is bumped every time the task is
    claimed for a run, and an outcome only applies when it names the current
    assignment.  ``attempt`` counts the task's own runs (1-based); refusals and
    "no agent" waits never bump it.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # Neither foreign key has an index of its own: uniq_task_per_execution leads with the
    # execution and the (tenant, status) index with the tenant.  A task row is updated
    # non-HOT three or four times in its life (status, agent_id and finished_at are indexed),
    # and each such update writes an entry into every index: two redundant ones were a
    # fifth of that work (docs/performance.md, "round i17-cpu").
    workflow_execution = models.ForeignKey(
        WorkflowExecution, on_delete=models.CASCADE, related_name="tasks", db_index=False
    )
    tenant = models.ForeignKey(
        "fleet.Tenant", on_delete=models.CASCADE, related_name="task_executions", db_index=False
    )
    task_name = models.CharField(max_length=200)  # the manifest's task id
    function = models.CharField(max_length=400)
    dependencies = models.JSONField(default=list)
    trigger_rule = models.CharField(
        max_length=12, choices=TriggerRule.choices, default=TriggerRule.ALL_SUCCESS
    )
    position = models.PositiveIntegerField(
        default=0
    )  # manifest order, for stable display and merging
    status = models.CharField(
        max_length=10, choices=TaskStatus.choices, default=TaskStatus.NOT_STARTED
    )
    attempt = models.PositiveIntegerField(default=0)
    max_retries = models.PositiveIntegerField(default=0)
    retry_backoff_s = models.FloatField(default=0.0)
    timeout_s = models.FloatField(default=300.0)
    routing = models.JSONField(default=dict, blank=True)  # optional selector keys from the manifest
    priority = models.IntegerField(default=0)
    ready_at = models.DateTimeField(
        null=True, blank=True
    )  # not dispatched before this (retry backoff)
    assignment = models.PositiveIntegerField(default=0)
    claimed_by = models.CharField(max_length=100, blank=True, default="")
    claimed_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    result_deadline = models.DateTimeField(null=True, blank=True)
    # Not indexed: no query looks tasks up by agent (only an agent's deletion, which the
    # server never does, would scan for them), and the placement sets it in an update of
    # its own, which an index on it kept from being HOT.
    agent = models.ForeignKey(
        "agents.Agent",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="tasks",
        db_index=False,
    )
    refusals = models.PositiveIntegerField(default=0)
    wait_reason = models.TextField(blank=True, default="")
    output_context = models.JSONField(null=True, blank=True)
    error_type = models.CharField(max_length=200, blank=True, default="")
    error_message = models.TextField(blank=True, default="")
    traceback = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["position"]
        constraints = [
            models.UniqueConstraint(
                fields=["workflow_execution", "task_name"], name="uniq_task_per_execution"
            ),
        ]
        indexes = [
            models.Index(fields=["status", "ready_at"], name="task_ready_idx"),
            models.Index(fields=["tenant", "status"]),
            # The health sampler reads the tasks that finished in the last minute.
            models.Index(
                fields=["finished_at"],
                name="task_finished_at_idx",
                condition=models.Q(finished_at__isnull=False),
            ),
        ]


class Outcome(models.TextChoices):
    SUCCESS = "success"
    FAILURE = "failure"
    REFUSED = "refused"
    TIMEOUT = "timeout"
    LOST = "lost"  # result-wait deadline passed with no outcome


class TaskOutcome(models.Model):
    """Every outcome reported for a task, applied or not (audit + idempotency)."""

    task_execution = models.ForeignKey(
        TaskExecution, on_delete=models.CASCADE, related_name="outcomes"
    )
    assignment = models.PositiveIntegerField()
    attempt = models.PositiveIntegerField()
    outcome = models.CharField(max_length=8, choices=Outcome.choices)
    applied = models.BooleanField(default=False)
    ignored_reason = models.CharField(max_length=200, blank=True, default="")
    agent_name = models.CharField(max_length=200, blank=True, default="")
    error_type = models.CharField(max_length=200, blank=True, default="")
    error_message = models.TextField(blank=True, default="")
    received_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            # At most one applied outcome per assignment: the database enforces exactly-once completion.
            models.UniqueConstraint(
                fields=["task_execution", "assignment"],
                condition=models.Q(applied=True),
                name="one_applied_outcome_per_assignment",
            ),
        ]
