"""Reclaiming a dead agent's work: its open outbox rows move to survivors.

An agent is declared dead by its lifecycle (:mod:`fleet.executors.fleet.lifecycle`: the liveness
sweep, an overdue drain, a replacing registration, a revoked key, a deregistration
with work in flight), which then calls :func:`reclaim_in_flight`.  Its open outbox
rows are moved, one transaction per row, to a live agent of the same tenant with a
free slot, reserved through the one placement path
(:func:`fleet.executors.fleet.delivery.placement.reserve_for_reclaim`) exactly as at dispatch: the
row is re-addressed and reset to pending (the NOTIFY wakes the relay holding the
survivor's socket), keeps its task_execution_id and assignment, and the task records
its new agent and loses its result deadline (the clock restarts at the next
delivery).  The dead agent's late result is then fenced off by the result handler.
Rows that find no survivor stay where they are and are tried again on every sweep
(:func:`reclaim_orphaned_work`) until a live agent of the tenant appears.

Routing (docs/routing.md): reclaimed work goes only to an agent its task's selectors
accept.
"""

from __future__ import annotations

import logging
import uuid

from django.db import connection, transaction
from django.db.models import F

from agents.models import ENDED_STATES, Agent
from artifacts.models import WorkflowPackage
from artifacts.store.queries import resolve_artifact, runnable_triples
from fleet.executors.fleet.delivery.placement import reserve_for_reclaim
from fleet.executors.fleet.state import ledger
from fleet.models import DeliveryOutbox, Eviction, TaskExecution, TaskStatus

log = logging.getLogger(__name__)


def reclaim_in_flight(agent_id: uuid.UUID) -> tuple[int, int]:
    """Move every open row of the dead agent to a survivor; return (moved, left).

    Called inside a caller's transaction (a registration replacing the agent holds the
    dead agent's row), a reservation must not wait for a survivor's row: that would be
    a second wait for agent rows, out of order (ledger module docstring, "Lock order").
    It then takes only survivors free right now; the rest wait for the next sweep."""
    wait = not connection.in_atomic_block
    rows = list(
        DeliveryOutbox.objects.filter(agent_id=agent_id, state__in=ledger.OPEN_STATES)
        .order_by("id")
        .values_list("id", "task_execution_id")
    )
    moved = 0
    for index, (row_id, task_execution_id) in enumerate(rows):
        result = move_row(row_id, task_execution_id, agent_id, wait)
        if result is None:  # no survivor with room: the rest wait for the next sweep
            left = len(rows) - index
            log.info("agent %s: %d packet(s) wait for a live agent of the tenant", agent_id, left)
            return moved, left
        moved += result
    return moved, 0


def reclaim_orphaned_work() -> int:
    """Retry rows still addressed to dead agents (no survivor had room before)."""
    dead = (
        DeliveryOutbox.objects.filter(state__in=ledger.OPEN_STATES, agent__state__in=ENDED_STATES)
        .values_list("agent_id", flat=True)
        .distinct()
    )
    return sum(reclaim_in_flight(agent_id)[0] for agent_id in list(dead))


def move_row(
    row_id: int, task_execution_id: uuid.UUID, dead_id: uuid.UUID, wait: bool = True
) -> int | None:
    """Re-address one row; 1 moved, 0 nothing to move (acked meanwhile), None no survivor.
    ``wait``: whether the reservation may wait for a survivor locked by another
    transaction (:func:`reclaim_in_flight`)."""
    with transaction.atomic():
        # Lock order task → outbox row → agent, as the result handler does (workflow → task → …).
        task = (
            TaskExecution.objects.select_for_update()
            .filter(pk=task_execution_id)
            .values(
                "status",
                "assignment",
                "tenant_id",
                "routing",
                "workflow_execution_id",
                "workflow_execution__package_id",
                "workflow_execution__workflow_name",
            )  # fmt: skip
            .first()
        )
        row = (
            DeliveryOutbox.objects.select_for_update()
            .filter(pk=row_id, agent_id=dead_id, state__in=ledger.OPEN_STATES)
            .first()
        )
        if row is None or task is None:
            return 0
        if task["status"] != TaskStatus.RUNNING or task["assignment"] != row.assignment:
            # The task moved on without this packet (e.g. declared lost): it is no longer work.
            ledger.close_row(row_id)
            return 0
        package = WorkflowPackage.objects.get(pk=task["workflow_execution__package_id"])
        survivor = reserve_for_reclaim(
            task_execution_id, task, runnable_triples(package), wait=wait
        )
        if survivor is None:
            return None
        artifact = resolve_artifact(package, survivor.target_triple)
        payload = dict(row.payload)
        if artifact is not None:
            payload.update(artifact_digest=artifact.digest, target_triple=artifact.target_triple)
        ledger.readdress_row(row, survivor.id, payload)
        TaskExecution.objects.filter(pk=task_execution_id, assignment=row.assignment).update(
            agent_id=survivor.id, result_deadline=None
        )
        _count_reassigned(dead_id, row.tenant_id)
    log.info("reclaimed packet %s of dead agent %s onto %s", row_id, dead_id, survivor.name)
    return 1


def _count_reassigned(dead_id: uuid.UUID, tenant_id: int) -> None:
    latest = Eviction.objects.filter(agent_id=dead_id).order_by("-evicted_at", "-id").first()
    if latest is None:  # dead without an eviction (e.g. marked dead elsewhere): record one
        agent = Agent.objects.filter(pk=dead_id).values("name", "last_heartbeat").first() or {}
        latest = Eviction.objects.create(
            agent_id=dead_id,
            tenant_id=tenant_id,
            agent_name=agent.get("name", ""),
            last_heartbeat=agent.get("last_heartbeat"),
            reason="work reclaimed from a dead agent",
        )
    Eviction.objects.filter(pk=latest.pk).update(reassigned=F("reassigned") + 1)
