"""Task logs: every statement that writes, reads or prunes ``fleet_taskattemptlog``.

One row per (task, attempt).  While an attempt runs, its executor appends live
chunks (:func:`append_live`: fenced on the task's current assignment, bounded to
CLOACINA_TASK_LOG_BYTES characters, at most one statement per chunk); with the
attempt's outcome the result handler writes the whole tail the task child kept
(:func:`store_final`, in the outcome's own transaction).  :func:`prune_logs` deletes
rows older than CLOACINA_TASK_LOG_RETENTION_DAYS on the leader every few minutes.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import connection
from django.utils import timezone

from agents.sandbox.task_log import TaskLog
from fleet.engine.context import storable_text
from fleet.engine.executor import PeriodicJob
from fleet.models import TaskAttemptLog
from fleet.platform.chunked_delete import delete_in_chunks
from fleet.platform.config import get_config

PRUNE_JOB_NAME = "task_log_prune"
PRUNE_INTERVAL_S = 300.0
PRUNE_CHUNK = 5_000
PRUNE_CHUNKS_PER_RUN = 10
TRACEBACK_MAX_CHARS = 20_000  # as the task row keeps it

# The outcome's log replaces whatever live chunks wrote for the attempt.
_STORE_FINAL = """
INSERT INTO fleet_taskattemptlog AS l (task_execution_id, attempt, assignment, text, bytes,
    truncated_bytes, finished, traceback, created_at, updated_at)
VALUES (%(task)s, %(attempt)s, %(assignment)s, %(text)s, %(bytes)s, %(truncated)s, true,
    %(traceback)s, now(), now())
ON CONFLICT (task_execution_id, attempt) DO UPDATE SET
    assignment = EXCLUDED.assignment, text = EXCLUDED.text, bytes = EXCLUDED.bytes,
    truncated_bytes = EXCLUDED.truncated_bytes, finished = true,
    traceback = EXCLUDED.traceback, updated_at = now()
"""
# A live chunk counts only for the task's current, running assignment (and, on the fleet,
# only from the agent holding it).  A chunk that skipped bytes (the ring overran between
# two looks) holds the ring's whole tail: it replaces the text instead of extending it.
_APPEND_LIVE = """
INSERT INTO fleet_taskattemptlog AS l (task_execution_id, attempt, assignment, text, bytes,
    truncated_bytes, finished, traceback, created_at, updated_at)
SELECT t.id, t.attempt, t.assignment, right(%(text)s, %(limit)s), %(end)s,
    GREATEST(%(end)s - octet_length(right(%(text)s, %(limit)s)), 0), false, '', now(), now()
FROM fleet_taskexecution t
WHERE t.id = %(task)s AND t.status = 'Running' AND t.assignment = %(assignment)s
  AND (%(tenant)s::bigint IS NULL OR t.tenant_id = %(tenant)s::bigint)
  AND (%(agent)s::uuid IS NULL OR t.agent_id = %(agent)s::uuid)
ON CONFLICT (task_execution_id, attempt) DO UPDATE SET
    text = CASE WHEN %(skipped)s > 0 THEN EXCLUDED.text
                ELSE right(l.text || EXCLUDED.text, %(limit)s) END,
    bytes = EXCLUDED.bytes,
    truncated_bytes = GREATEST(EXCLUDED.bytes - octet_length(
        CASE WHEN %(skipped)s > 0 THEN EXCLUDED.text
             ELSE right(l.text || EXCLUDED.text, %(limit)s) END), 0),
    updated_at = now()
WHERE NOT l.finished AND l.assignment = EXCLUDED.assignment AND l.bytes < EXCLUDED.bytes
"""
# Oldest first, a bounded chunk per statement: a long-neglected table is worked down
# over several runs instead of one huge delete.
_PRUNE = """
DELETE FROM fleet_taskattemptlog WHERE id IN (
    SELECT id FROM fleet_taskattemptlog WHERE updated_at < %s ORDER BY updated_at LIMIT %s
)
"""


@dataclass(frozen=True)
class LiveChunk:
    """Output an executor read from a running attempt since its last chunk."""

    task_execution_id: uuid.UUID
    assignment: int
    text: str
    end: int  # the attempt's bytes written, this chunk included
    skipped: int = 0  # bytes between the last chunk and this one that were dropped


def has_content(log: TaskLog | None, traceback: str) -> bool:
    """Whether an outcome leaves anything to show: a task that printed nothing and did not
    fail costs the outcome no extra statement."""
    return bool(traceback) or (log is not None and log.bytes > 0)


def store_final(
    cursor, task_execution_id: uuid.UUID, attempt: int, assignment: int,
    log: TaskLog | None, traceback: str,
) -> None:  # fmt: skip
    """Record an applied outcome's log and traceback (in the caller's transaction)."""
    log = bounded(log or TaskLog("", 0, 0), get_config().task_log_bytes)
    cursor.execute(
        _STORE_FINAL,
        {
            "task": task_execution_id,
            "attempt": attempt,
            "assignment": assignment,
            "text": storable_text(log.text),
            "bytes": max(log.bytes, 0),
            "truncated": max(log.truncated_bytes, 0),
            "traceback": storable_text(traceback[:TRACEBACK_MAX_CHARS]),
        },
    )


def bounded(log: TaskLog, limit: int) -> TaskLog:
    """The last ``limit`` bytes of ``log``: the server keeps its own bound, whatever ring
    size an agent was configured with (what an agent sends is tenant input)."""
    data = log.text.encode("utf-8")
    if len(data) <= limit:
        return log
    tail = data[len(data) - limit :].decode("utf-8", errors="ignore")  # a cut character goes
    dropped = len(data) - len(tail.encode("utf-8"))
    return TaskLog(tail, log.bytes, log.truncated_bytes + dropped)


def append_live(
    chunk: LiveChunk, tenant_id: int | None = None, agent_id: uuid.UUID | None = None
) -> bool:
    """Add a running attempt's new output to its log; False when it does not count (the
    task moved on, another agent holds it, another tenant's task, a stale chunk)."""
    with connection.cursor() as cursor:
        cursor.execute(
            _APPEND_LIVE,
            {
                "text": storable_text(chunk.text),
                "limit": get_config().task_log_bytes,
                "end": chunk.end,
                "skipped": chunk.skipped,
                "task": chunk.task_execution_id,
                "assignment": chunk.assignment,
                "tenant": tenant_id,
                "agent": agent_id,
            },
        )
        return cursor.rowcount == 1


def append_live_many(chunks: list[LiveChunk], tenant_id: int, agent_id: uuid.UUID) -> int:
    """An agent's ``log`` frames of one socket batch, in the order sent; how many counted."""
    return sum(append_live(chunk, tenant_id, agent_id) for chunk in chunks)


def rendered(entry: TaskAttemptLog) -> str:
    """The log as a reader sees it: the truncation line first when its front was dropped."""
    return TaskLog(entry.text, entry.bytes, entry.truncated_bytes).render()


def attempt_logs(task_execution_id: uuid.UUID) -> dict[int, TaskAttemptLog]:
    """The task's logs by attempt (the caller has checked the task is the reader's)."""
    return {
        entry.attempt: entry
        for entry in TaskAttemptLog.objects.filter(task_execution_id=task_execution_id)
    }


def attempt_log(task_execution_id: uuid.UUID, attempt: int) -> TaskAttemptLog | None:
    return TaskAttemptLog.objects.filter(
        task_execution_id=task_execution_id, attempt=attempt
    ).first()


def prune_logs(now: datetime | None = None) -> int:
    """Delete logs not written for CLOACINA_TASK_LOG_RETENTION_DAYS; how many went."""
    days = get_config().task_log_retention_days
    if days <= 0:
        return 0
    cutoff = (now or timezone.now()) - timedelta(days=days)
    return delete_in_chunks(_PRUNE, cutoff, PRUNE_CHUNK, PRUNE_CHUNKS_PER_RUN)


def task_log_jobs() -> list[PeriodicJob]:
    """For ``serve``: pruning old logs, on the leader, every few minutes."""
    return [PeriodicJob(PRUNE_JOB_NAME, prune_logs, PRUNE_INTERVAL_S, leader_only=True)]
