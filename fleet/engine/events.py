"""The dispatcher's vocabulary (seed: Dispatcher Architecture).

A TaskReadyEvent carries no context: executors load it from the database at
execution time so they always see the latest state.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TaskReadyEvent:
    task_execution_id: uuid.UUID
    workflow_execution_id: uuid.UUID
    task_name: str
    attempt: int  # the attempt this run will be (1-based)
    # Ordering hints for the dispatch queue (fleet/engine/fair_queue.py), not identity:
    # tenants take turns, then the higher priority goes first.  0 when unknown.
    tenant_id: int = field(default=0, compare=False)
    priority: int = field(default=0, compare=False)


class ExecutionStatus(enum.Enum):
    COMPLETED = "Completed"
    FAILED = "Failed"
    RETRY = "Retry"  # failed, another attempt is scheduled
    REQUEUED = "Requeued"  # not run (no agent, refused): back to Ready without using an attempt
    SUPERSEDED = "Superseded"  # outcome ignored: the task was reassigned or already finished


@dataclass(frozen=True)
class ExecutionResult:
    task_execution_id: uuid.UUID
    status: ExecutionStatus
    error: str | None = None
    duration_s: float = 0.0


@dataclass
class ExecutorMetrics:
    active_tasks: int = 0
    max_concurrent: int = 0
    total_executed: int = 0
    total_failed: int = 0
    avg_duration_ms: float = 0.0
    extra: dict = field(default_factory=dict)


class DispatchError(Exception):
    """Base of the dispatcher's errors."""


class ExecutorNotFound(DispatchError):
    """No executor is registered under the configured key."""

    def __init__(self, key: str, valid: list[str]) -> None:
        self.key = key
        self.valid = valid
        super().__init__(
            f"unknown default executor {key!r}; valid keys: {', '.join(sorted(valid))}"
        )


class NoCapacity(DispatchError):
    """The executor is full; the task stays Ready and is dispatched later."""


class ExecutionFailed(DispatchError):
    """The executor could not run the task: the dispatcher records a failed attempt and the
    task's retry policy decides (retry after its backoff, or fail).

    ``assignment``: the claim's fencing token when the executor had claimed the task (the
    failure is recorded against that claim only).  Without it, the dispatcher uses this
    server's own claim on the task, or claims it, so a failure before the claim is an
    attempt too.  ``retryable=False``: no retry could help (the task fails now).
    """

    def __init__(
        self,
        message: str,
        *,
        assignment: int | None = None,
        error_type: str = "ExecutionFailed",
        retryable: bool = True,
    ) -> None:
        super().__init__(message)
        self.assignment = assignment
        self.error_type = error_type
        self.retryable = retryable
