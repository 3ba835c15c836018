"""Acking outbox rows and releasing the agent slot they held: the fleet's settle hook.

A row is acked exactly when the outcome for its (task, assignment) is
recorded, in the same transaction, so until then it is in-flight work that
the liveness sweeper can move to a survivor.  The engine knows no outbox: the
result handler folds :data:`OUTBOX_SETTLE_HOOK`'s fragments into its own
statements (fleet/engine/hooks.py), so the ack and the slot release cost no
statement of their own on the hot path.
"""

from __future__ import annotations

import uuid

from django.db import connection

from fleet.engine.hooks import SettleHook, register_settle_hook
from fleet.models import TaskStatus

# Ack the packets of the settling (task, assignment) rows; the agents they were on are
# returned as ``held``.  Locked after the task and workflow rows, the agent row last.
_ACK = """, held AS (
    UPDATE delivery_outbox o SET state = 'acked', acked_at = now(), updated_at = now()
    FROM {settling} s WHERE o.task_id = s.task_execution_id
      AND o.assignment = s.assignment AND o.state <> 'acked'
    RETURNING o.agent_id AS holder
)"""
_FREE_ACKED = """, freed AS (
    UPDATE agents_agent SET in_flight = GREATEST(in_flight - 1, 0)
    WHERE id IN (SELECT holder FROM held)
)"""
# Every agent row once, in id order (so two such transactions never deadlock), each
# slot counter lowered by the number of its packets acked.
_RELEASE_SLOTS = """
WITH n AS (
    SELECT agent_id, count(*) AS n FROM unnest(%s::uuid[]) AS r(agent_id) GROUP BY agent_id
), locked AS (
    SELECT a.id FROM agents_agent a JOIN n ON n.agent_id = a.id ORDER BY a.id FOR UPDATE OF a
)
UPDATE agents_agent a SET in_flight = GREATEST(a.in_flight - n.n, 0)
FROM n, locked WHERE a.id = n.agent_id AND locked.id = a.id
"""


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


def release_slots(agent_ids: list[uuid.UUID]) -> None:
    """Free one slot per entry of ``agent_ids`` (in the caller's transaction)."""
    if agent_ids:
        with connection.cursor() as cursor:
            cursor.execute(_RELEASE_SLOTS, [list(agent_ids)])


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


class OutboxSettleHook(SettleHook):
    """The fleet executor's side of an outcome: ack the packet, free the agent's slot."""

    def settle_ctes(self, settling: str, release: bool) -> str:
        return _ACK.format(settling=settling) + (_FREE_ACKED if release else "")

    def release(self, holders: list) -> None:
        release_slots(holders)

    def withdraw_undelivered(self, workflow_execution_id: uuid.UUID) -> int:
        return withdraw_undelivered(workflow_execution_id)

    def holds_sql(self, task: str) -> str:
        return (
            f"EXISTS (SELECT 1 FROM delivery_outbox o"
            f" WHERE o.task_id = {task}.id AND o.assignment = {task}.assignment)"
        )


OUTBOX_SETTLE_HOOK = OutboxSettleHook()


def register() -> None:
    """Register the fleet's settle hook with the engine (idempotent)."""
    register_settle_hook(OUTBOX_SETTLE_HOOK)
