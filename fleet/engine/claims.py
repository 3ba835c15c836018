"""Claiming Ready tasks: one atomic statement, so no two server processes run the same task.

A claim moves the task Ready → Running, bumps ``assignment`` (the fencing
token every outcome must name) and ``attempt``, and moves the workflow
Pending → Running.  ``release_claim`` undoes a claim that never ran (no agent,
a refusal) without using up an attempt.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from django.db import connection, transaction

# "Due" compares ready_at (written from the server's clock) with statement_timestamp(), not
# now(): now() is frozen at the start of the enclosing transaction, so a claim made
# inside a longer transaction would not see a task that became due during it.

# Extra time beyond a task's own timeout before a run with no outcome is declared lost.
RESULT_GRACE_S = 30.0

_CLAIM_COLUMNS = """
    t.id, t.workflow_execution_id, t.tenant_id, t.task_id, t.function, t.assignment,
    t.attempt, t.timeout_s, t.routing, t.priority
"""


@dataclass(frozen=True)
class Claim:
    """What the claimer needs to run one task (the fencing token is ``assignment``)."""

    task_execution_id: uuid.UUID
    workflow_execution_id: uuid.UUID
    tenant_id: int
    task_name: str
    function: str
    assignment: int
    attempt: int
    timeout_s: float
    routing: dict
    priority: int


def _claims(rows) -> list[Claim]:
    return [Claim(*row) for row in rows]


def _mark_workflows_running(workflow_ids: set) -> None:
    if workflow_ids:
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE fleet_workflowexecution SET status = 'Running', started_at = now() "
                "WHERE id = ANY(%s) AND status = 'Pending'",
                [list(workflow_ids)],
            )


def _relax_commit(outermost: bool) -> None:
    """Let this claim's commit skip the WAL flush (only when the claim is its own transaction).

    A claim need not survive a database crash on its own: a lost claim leaves
    the task Ready, so it simply runs again (at-least-once), and an outcome's
    commit is synchronous, which flushes the WAL, claim included, before it.
    This halves the fsyncs on the hot path.
    """
    if outermost:
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL synchronous_commit = off")


def claim_task(task_execution_id: uuid.UUID, claimer: str, deadline: bool = True) -> Claim | None:
    """Claim one Ready task; None when someone else got it first (or it is not due yet).

    ``deadline=False`` leaves ``result_deadline`` unset: the fleet starts the
    result-wait clock only once a packet is actually delivered to an agent.
    """
    outermost = not connection.in_atomic_block
    with transaction.atomic(), connection.cursor() as cursor:
        _relax_commit(outermost)
        cursor.execute(
            f"""
            UPDATE fleet_taskexecution AS t SET
                status = 'Running', assignment = t.assignment + 1, attempt = t.attempt + 1,
                claimed_by = %s, claimed_at = now(), started_at = now(), wait_reason = '',
                result_deadline = CASE WHEN %s THEN now() + make_interval(secs => t.timeout_s + %s) END
            WHERE t.id = %s AND t.status = 'Ready' AND (t.ready_at IS NULL OR t.ready_at <= statement_timestamp())
            RETURNING {_CLAIM_COLUMNS}
            """,
            [claimer, deadline, RESULT_GRACE_S, task_execution_id],
        )
        claims = _claims(cursor.fetchall())
        _mark_workflows_running({c.workflow_execution_id for c in claims})
    return claims[0] if claims else None


def claim_ready_tasks(claimer: str, limit: int, deadline: bool = True) -> list[Claim]:
    """Claim up to ``limit`` due Ready tasks, highest priority then oldest first (SKIP LOCKED)."""
    outermost = not connection.in_atomic_block
    with transaction.atomic(), connection.cursor() as cursor:
        _relax_commit(outermost)
        cursor.execute(
            f"""
            UPDATE fleet_taskexecution AS t SET
                status = 'Running', assignment = t.assignment + 1, attempt = t.attempt + 1,
                claimed_by = %s, claimed_at = now(), started_at = now(), wait_reason = '',
                result_deadline = CASE WHEN %s THEN now() + make_interval(secs => t.timeout_s + %s) END
            FROM (
                SELECT id FROM fleet_taskexecution
                WHERE status = 'Ready' AND (ready_at IS NULL OR ready_at <= statement_timestamp())
                ORDER BY priority DESC, ready_at NULLS FIRST
                LIMIT %s FOR UPDATE SKIP LOCKED
            ) AS due
            WHERE t.id = due.id
            RETURNING {_CLAIM_COLUMNS}
            """,
            [claimer, deadline, RESULT_GRACE_S, limit],
        )
        claims = _claims(cursor.fetchall())
        _mark_workflows_running({c.workflow_execution_id for c in claims})
    return claims


def due_ready_task_events(limit: int) -> list[tuple]:
    """(id, workflow_execution_id, task_id, attempt + 1) of due Ready tasks, oldest first, unlocked."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT id, workflow_execution_id, task_id, attempt + 1 FROM fleet_taskexecution
            WHERE status = 'Ready' AND (ready_at IS NULL OR ready_at <= statement_timestamp())
            ORDER BY priority DESC, ready_at NULLS FIRST LIMIT %s
            """,
            [limit],
        )
        return cursor.fetchall()


def release_claim(
    task_execution_id: uuid.UUID, assignment: int, reason: str, refused: bool = False
) -> bool:
    """Put a claimed-but-not-run task back to Ready without using up an attempt.

    The assignment stays bumped, so any outcome for the released run is fenced off.
    """
    with connection.cursor() as cursor:
        cursor.execute(
            """
            UPDATE fleet_taskexecution SET
                status = 'Ready', attempt = GREATEST(attempt - 1, 0), wait_reason = %s,
                agent_id = NULL, claimed_by = '', result_deadline = NULL,
                refusals = refusals + %s
            WHERE id = %s AND assignment = %s AND status = 'Running'
            """,
            [reason, 1 if refused else 0, task_execution_id, assignment],
        )
        return cursor.rowcount == 1
