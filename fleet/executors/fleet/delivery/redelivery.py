"""The safety net for pushes that did not land, and the agent's own account of what it holds.

A delivered row goes back to pending (and the relay pushes it again) only when
nobody confirmed it reached the agent:

* it was not ``received`` within ``outbox_redeliver_s`` of the push, or
* the agent reconnected and its ``hello`` does not list it.

A delivered row that the agent confirmed (``received_at``) is never pushed
again while the agent lives, however long the task runs: if the agent dies,
the liveness sweep moves it instead.

Each unconfirmed push counts as a failure of its agent's circuit breaker
(:mod:`fleet.executors.fleet.state.breaker`).

Re-pushes are bounded: after ``outbox_max_pushes`` unconfirmed pushes to one
agent the run is declared lost and goes through the task's retry policy, so no
interleaving of reconnects, re-registrations and reclaims can leave a task
Running for ever behind a packet that its agent keeps ignoring.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from django.db import connection, transaction

from fleet.engine import ready_queue
from fleet.engine.results import TaskReport, result_handler
from fleet.executors.fleet.delivery.metrics import UNCONFIRMED_LOST
from fleet.executors.fleet.state import breaker, ledger
from fleet.models import Outcome
from fleet.platform.config import get_config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unconfirmed:
    outbox_id: int
    task_execution_id: uuid.UUID
    assignment: int
    agent_name: str


def redeliver_unreceived(redeliver_s: float | None = None, max_pushes: int | None = None) -> int:
    """Push again the delivered rows of living agents not ``received`` within
    ``redeliver_s``; a row pushed ``max_pushes`` times to its agent without a
    confirmation has its run declared lost instead (:func:`declare_unconfirmed_lost`).

    An agent that ignores a packet (a bug, or an agent that no longer knows it) would
    otherwise get it re-pushed for ever, each push restarting the run's result clock:
    the task would stay Running with nobody running it.  Returns the rows requeued.
    """
    config = get_config()
    seconds = config.outbox_redeliver_s if redeliver_s is None else redeliver_s
    limit = config.outbox_max_pushes if max_pushes is None else max_pushes
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(ledger.UNCONFIRMED, {"seconds": seconds, "max_pushes": limit})
        rows = cursor.fetchall()
        requeue = [row[0] for row in rows if not row[3]]
        if requeue:
            cursor.execute(ledger.REQUEUE_UNCONFIRMED, [requeue])
        # Every unconfirmed push (re-pushed or given up) counts against its agent's breaker.
        breaker.record_failures([row[5] for row in rows], breaker.Cause.PUSH)
    exhausted = [Unconfirmed(r[0], r[1], r[2], r[4]) for r in rows if r[3]]
    if exhausted:
        declare_unconfirmed_lost(exhausted, limit)
    return len(requeue)


def declare_unconfirmed_lost(rows: list[Unconfirmed], pushes: int) -> int:
    """Each row's run is ``lost`` (through the one result handler: its retry policy
    applies, the packet is acked and the agent's slot freed); returns how many applied."""
    applied = 0
    for row in rows:
        with transaction.atomic():
            outcome = result_handler.apply(
                TaskReport(
                    row.task_execution_id,
                    row.assignment,
                    Outcome.LOST,
                    error_type="PacketUnconfirmed",
                    error_message=(
                        f"work packet {row.outbox_id} was pushed {pushes} times to agent "
                        f"{row.agent_name} and never confirmed"
                    ),
                )
            )
            if not outcome.applied:
                with connection.cursor() as cursor:
                    cursor.execute(ledger.CLOSE_STALE, [row.outbox_id])
        if outcome.applied:
            applied += 1
            ready_queue.submit(outcome.ready)
        UNCONFIRMED_LOST.inc()
        log.warning(
            "work packet %s (task %s #%s) pushed %d times to agent %s without a confirmation: "
            "%s",
            row.outbox_id, row.task_execution_id, row.assignment, pushes, row.agent_name,
            "run declared lost" if outcome.applied else f"closed ({outcome.reason})",
        )  # fmt: skip
    return applied


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
    held = "SELECT * FROM unnest(%s::uuid[], %s::int[]) AS h(task_execution_id, assignment)"
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(ledger.HELLO_CONFIRM.format(held=held), [tasks, assignments, agent_id])
        confirmed = cursor.rowcount
        cursor.execute(ledger.HELLO_REQUEUE.format(held=held), [agent_id, tasks, assignments])
        return confirmed, cursor.rowcount


def mark_received(agent_id: uuid.UUID, outbox_ids: list[int]) -> int:
    """The agent confirmed these packets; only rows addressed to this agent are touched."""
    if not outbox_ids:
        return 0
    with connection.cursor() as cursor:
        cursor.execute(ledger.MARK_RECEIVED, [agent_id, outbox_ids])
        return cursor.rowcount


def mark_running_received(agent_id: uuid.UUID, task_execution_ids: list[uuid.UUID]) -> int:
    """A heartbeat's ``running`` list confirms those packets too (a lost ``received`` frame)."""
    if not task_execution_ids:
        return 0
    with connection.cursor() as cursor:
        cursor.execute(ledger.MARK_RUNNING_RECEIVED, [agent_id, task_execution_ids])
        return cursor.rowcount
