"""Acking outbox rows and releasing the agent slot they held.

A row is acked exactly when the outcome for its (task, assignment) is
recorded, in the same transaction, so until then it is in-flight work that
the liveness sweeper can move to a survivor.
"""

from __future__ import annotations

import uuid

from django.db import connection

from fleet.models import TaskStatus


def ack_and_release(task_execution_id: uuid.UUID, assignment: int) -> bool:
    """Ack the row of this assignment and free the slot it reserved on its agent."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            WITH acked AS (
                UPDATE delivery_outbox SET state = 'acked', acked_at = now(), updated_at = now()
                WHERE task_id = %s AND assignment = %s AND state <> 'acked'
                RETURNING agent_id
            )
            UPDATE agents_agent SET in_flight = GREATEST(in_flight - 1, 0)
            WHERE id IN (SELECT agent_id FROM acked)
            """,
            [task_execution_id, assignment],
        )
        return cursor.rowcount > 0


def withdraw_undelivered(workflow_execution_id: uuid.UUID) -> int:
    """On cancel: tasks whose packet was never delivered are Skipped and their rows acked."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            WITH rows AS (
                UPDATE delivery_outbox o SET state = 'acked', acked_at = now(), updated_at = now()
                FROM fleet_taskexecution t
                WHERE o.task_id = t.id AND o.assignment = t.assignment AND o.state = 'pending'
                  AND t.workflow_execution_id = %s AND t.status = 'Running'
                RETURNING o.agent_id, o.task_id
            ), freed AS (
                UPDATE agents_agent a SET in_flight = GREATEST(a.in_flight - n.cnt, 0)
                FROM (SELECT agent_id, count(*) AS cnt FROM rows GROUP BY agent_id) n
                WHERE a.id = n.agent_id
            )
            UPDATE fleet_taskexecution SET status = %s, finished_at = now(), error_message = 'cancelled'
            WHERE id IN (SELECT task_id FROM rows)
            """,
            [workflow_execution_id, TaskStatus.SKIPPED],
        )
        return cursor.rowcount
