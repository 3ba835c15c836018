"""The safety net for pushes that did not land, and the agent's own account of what it holds.

A delivered row goes back to pending (and the relay pushes it again) only when
nobody confirmed it reached the agent:

* it was not ``received`` within ``outbox_redeliver_s`` of the push, or
* the agent reconnected and its ``hello`` does not list it.

A delivered row that the agent confirmed (``received_at``) is never pushed
again while the agent lives, however long the task runs: if the agent dies,
the liveness sweep moves it instead.
"""

from __future__ import annotations

import uuid

from django.db import connection, transaction

from cloacina_site.config import get_config


def redeliver_unreceived(redeliver_s: float | None = None) -> int:
    """Reset delivered-but-never-received rows of living agents older than ``redeliver_s``."""
    seconds = get_config().outbox_redeliver_s if redeliver_s is None else redeliver_s
    with connection.cursor() as cursor:
        cursor.execute(
            """
            UPDATE delivery_outbox o SET state = 'pending', delivered_at = NULL, updated_at = now()
            FROM agents_agent a
            WHERE a.id = o.agent_id AND a.state <> 'dead'
              AND o.state = 'delivered' AND o.received_at IS NULL
              AND o.delivered_at < now() - make_interval(secs => %s)
            """,
            [seconds],
        )
        return cursor.rowcount


MAX_ASSIGNMENT = 2**31 - 1  # the int[] the holding list is cast to (an int4 column)


def _holding_arrays(holding: list[tuple[uuid.UUID, int]]) -> tuple[list, list]:
    # The socket refuses such a hello (4400); here an assignment no row can have is dropped
    # rather than let it fail the cast (it matches nothing either way).
    held = [h for h in holding if isinstance(h[1], int) and 1 <= h[1] <= MAX_ASSIGNMENT]
    return [h[0] for h in held], [h[1] for h in held]


def apply_hello(agent_id: uuid.UUID, holding: list[tuple[uuid.UUID, int]]) -> tuple[int, int]:
    """After a reconnect: rows the agent holds count as received, delivered rows it does
    not hold go back to pending.  Returns (confirmed, requeued)."""
    tasks, assignments = _holding_arrays(holding)
    held = "SELECT * FROM unnest(%s::uuid[], %s::int[]) AS h(task_id, assignment)"
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            f"""
            UPDATE delivery_outbox o SET received_at = coalesce(o.received_at, now())
            FROM ({held}) AS h
            WHERE o.agent_id = %s AND o.state = 'delivered'
              AND o.task_id = h.task_id AND o.assignment = h.assignment
            """,
            [tasks, assignments, agent_id],
        )
        confirmed = cursor.rowcount
        cursor.execute(
            f"""
            UPDATE delivery_outbox o SET state = 'pending', delivered_at = NULL,
                received_at = NULL, updated_at = now()
            WHERE o.agent_id = %s AND o.state = 'delivered'
              AND (o.task_id, o.assignment) NOT IN ({held})
            """,
            [agent_id, tasks, assignments],
        )
        return confirmed, cursor.rowcount


def mark_received(agent_id: uuid.UUID, outbox_ids: list[int]) -> int:
    """The agent confirmed these packets; only rows addressed to this agent are touched."""
    if not outbox_ids:
        return 0
    with connection.cursor() as cursor:
        cursor.execute(
            """
            UPDATE delivery_outbox SET received_at = now()
            WHERE agent_id = %s AND id = ANY(%s) AND state = 'delivered' AND received_at IS NULL
            """,
            [agent_id, outbox_ids],
        )
        return cursor.rowcount


def mark_running_received(agent_id: uuid.UUID, task_ids: list[uuid.UUID]) -> int:
    """A heartbeat's ``running`` list confirms those packets too (a lost ``received`` frame)."""
    if not task_ids:
        return 0
    with connection.cursor() as cursor:
        cursor.execute(
            """
            UPDATE delivery_outbox SET received_at = now()
            WHERE agent_id = %s AND task_id = ANY(%s) AND state = 'delivered' AND received_at IS NULL
            """,
            [agent_id, task_ids],
        )
        return cursor.rowcount
