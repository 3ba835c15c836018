"""Recovery sweeps: runs that will never report, and claims whose server process died.

* :func:`expire_lost_runs`: a Running task past its ``result_deadline`` gets a
  ``lost`` outcome through the one result handler, so its retry policy applies.
* :func:`sweep_dead_servers`: a server that stopped heartbeating took its
  in-process runs with it.  Its Running claims that have no outbox row (they
  were never handed to an agent) go back to Ready without using an attempt.

Both are idempotent and safe to run in several processes at once (claims and
outcomes are fenced by ``assignment``); `serve` still runs them leader-only.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.db import connection, transaction
from django.utils import timezone

from fleet.engine import hooks, ready_queue, server_registry
from fleet.engine.claims import release_claim
from fleet.engine.events import TaskReadyEvent
from fleet.engine.executor import PeriodicJob
from fleet.engine.results import TaskReport, result_handler
from fleet.models import Outcome, TaskExecution, TaskStatus

log = logging.getLogger(__name__)

LOST_RUN_SWEEP_S = 5.0
LOST_BATCH = 500  # per tick; the next tick takes the rest


def expire_lost_runs(limit: int = LOST_BATCH) -> int:
    """Report ``lost`` for Running tasks past their result deadline; return how many applied."""
    overdue = list(
        TaskExecution.objects.filter(
            status=TaskStatus.RUNNING, result_deadline__lt=timezone.now()
        ).values_list("id", "assignment", "result_deadline", "agent_id")[:limit]
    )
    applied = 0
    holders = []
    for task_execution_id, assignment, deadline, agent_id in overdue:
        outcome = result_handler.apply(
            TaskReport(
                task_execution_id,
                assignment,
                Outcome.LOST,
                error_type="ResultLost",
                error_message=f"no outcome reported by the result deadline {deadline.isoformat()}",
            )
        )
        if outcome.applied:
            applied += 1
            ready_queue.submit(outcome.ready)
            if agent_id is not None:
                holders.append(agent_id)
    hooks.runs_lost(holders)  # the executor's side (the fleet: its agents' breakers)
    if applied:
        log.warning("declared %d run(s) lost after their result deadline", applied)
    return applied


def release_orphaned_claims(instance_id: str, reason: str) -> int:
    """Back to Ready: Running tasks claimed by ``instance_id`` that no agent was given.

    A task the executor holds (the fleet's settle hook: an outbox row for its current
    assignment) belongs to an agent (the fleet's liveness sweeper owns it); without one
    it was running inside the server process, or was between claim and hand-off, and
    is gone.
    """
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            SELECT t.id, t.assignment, t.workflow_execution_id, t.task_name, t.attempt,
                   t.tenant_id, t.priority
            FROM fleet_taskexecution t
            WHERE t.status = 'Running' AND t.claimed_by = %s
              AND NOT ({hooks.holds_sql("t")})
            """,
            [instance_id],
        )
        rows = cursor.fetchall()
    events = []
    for task_execution_id, assignment, workflow_id, name, attempt, tenant_id, priority in rows:
        if release_claim(task_execution_id, assignment, reason):
            # release_claim gives the attempt back, so the next run is attempt `attempt` again.
            events.append(
                TaskReadyEvent(
                    task_execution_id, workflow_id, name, max(attempt, 1), tenant_id, priority
                )
            )
    ready_queue.submit(events)
    if events:
        log.warning("released %d claim(s) of server %s: %s", len(events), instance_id, reason)
    return len(events)


def sweep_dead_servers() -> list[str]:
    """Mark silent server instances stopped and release their in-process claims."""
    cutoff = timezone.now() - timedelta(seconds=server_registry.dead_after_s())
    swept = []
    for instance_id in server_registry.silent_instances():
        with transaction.atomic():
            if not server_registry.claim_dead_instance(instance_id, cutoff):
                continue  # it beat again, or a peer swept it first
            release_orphaned_claims(instance_id, f"server {instance_id} stopped heartbeating")
        swept.append(instance_id)
    return swept


def shutdown_cleanup(instance_id: str) -> int:
    """On a clean stop: mark this instance stopped and release its unfinished in-process claims."""
    with transaction.atomic():
        server_registry.mark_stopped(instance_id)
        return release_orphaned_claims(instance_id, f"server {instance_id} shut down")


def recovery_jobs() -> list[PeriodicJob]:
    """The recovery sweeps as `serve` periodic jobs (each one leader-only per tick)."""
    interval = server_registry.heartbeat_interval_s()
    return [
        PeriodicJob("expire_lost_runs", expire_lost_runs, LOST_RUN_SWEEP_S, leader_only=True),
        PeriodicJob("sweep_dead_servers", sweep_dead_servers, interval, leader_only=True),
    ]
