"""``ExecutionFailed`` raised by an executor, recorded as the seed says: retry or fail by policy.

An executor that raises instead of returning leaves its task claimed (Running)
or still Ready.  Left alone, a claimed task would sit Running until its result
deadline and a Ready one would be offered to the same broken executor forever.
Here the failure becomes an ordinary failure report through the one result
handler, fenced on the claim: the attempt is used, and the task's retry policy
(max_retries, backoff) decides whether it runs again or fails.
"""

from __future__ import annotations

import uuid

from django.db import close_old_connections, connection

from fleet.engine import ready_queue
from fleet.engine.claims import claim_task
from fleet.engine.events import ExecutionFailed, ExecutionResult, ExecutionStatus, TaskReadyEvent
from fleet.engine.results import TaskReport, TaskResultHandler
from fleet.models import Outcome

_OWN_CLAIM = """
SELECT assignment FROM fleet_taskexecution
WHERE id = %s AND status = 'Running' AND claimed_by = %s
"""


def record_execution_failure(
    event: TaskReadyEvent, failure: ExecutionFailed, claimer: str
) -> ExecutionResult:
    """Record ``failure`` as a failed attempt of the event's task (blocking: a worker thread).

    SUPERSEDED when the failure belongs to no claim we hold (someone else runs the task,
    or it already finished): nothing is written then.
    """
    close_old_connections()
    try:
        assignment = failure.assignment
        if assignment is None:
            assignment = _claim_for_failure(event.task_execution_id, claimer)
        if assignment is None:
            return ExecutionResult(
                event.task_execution_id,
                ExecutionStatus.SUPERSEDED,
                f"executor failure not recorded (not this server's claim): {failure}",
            )
        applied = TaskResultHandler().apply(
            TaskReport(
                event.task_execution_id,
                assignment,
                Outcome.FAILURE,
                error_type=failure.error_type,
                error_message=str(failure),
                retryable=failure.retryable,
            )
        )
        ready_queue.submit(applied.ready)
        return ExecutionResult(
            event.task_execution_id, applied.status, applied.reason or str(failure)
        )
    finally:
        # A thread of the loop's default pool: give its connection back rather than
        # keep one open per thread for a path that is rare.
        connection.close()


def _claim_for_failure(task_execution_id: uuid.UUID, claimer: str) -> int | None:
    """This server's claim on the task, or a new one if it is still Ready and due."""
    with connection.cursor() as cursor:
        cursor.execute(_OWN_CLAIM, [task_execution_id, claimer])
        row = cursor.fetchone()
    if row is not None:
        return int(row[0])
    claim = claim_task(task_execution_id, claimer)
    return claim.assignment if claim is not None else None
