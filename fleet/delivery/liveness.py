"""Dead agents: the liveness sweep, the eviction record, and reclaiming their work.

An agent is dead after ``heartbeat_interval_s × liveness_misses`` without a
heartbeat.  Declaring it dead is a compare-and-set on its row, so several
server processes sweeping at once evict it once.  Its non-acked outbox rows
are then moved, one transaction per row, to a live agent of the same tenant
with a free slot (reserved atomically, exactly as at dispatch): the row is
re-addressed and reset to pending (the NOTIFY wakes the relay holding the
survivor's socket), keeps its task_execution_id and assignment, and the task
records its new agent and loses its result deadline (the clock restarts at
the next delivery).  The dead agent's late result is then fenced off by the
result handler.  Rows that find no survivor stay where they are and are
tried again on every sweep until a live agent of the tenant appears.

Routing (docs/routing.md): a dead agent's group/affinity bindings are cleared with
its eviction, and reclaimed work goes only to an agent its task's selectors accept.
The sweep also evicts agents past their drain deadline and drops the group bindings
of finished executions.
"""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta

from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from agents.models import Agent, AgentState
from artifacts.models import WorkflowPackage
from artifacts.queries import resolve_artifact, runnable_triples
from cloacina_site.config import get_config
from fleet.engine.context import build_task_context
from fleet.models import DeliveryOutbox, Eviction, OutboxState, TaskExecution, TaskStatus
from fleet.routing import affinity, groups, selection
from fleet.routing.reservation import reserve_agent
from fleet.routing.selectors import SelectorError

log = logging.getLogger(__name__)

OPEN_STATES = (OutboxState.PENDING, OutboxState.DELIVERED)


def liveness_reason(interval_s: float, misses: int) -> str:
    return f"no heartbeat for {interval_s * misses:g}s ({misses} missed beats of {interval_s:g}s)"


def sweep_dead_agents() -> list[Eviction]:
    """Evict agents past the liveness window, then retry reclaiming work left on dead agents."""
    config = get_config()
    cutoff = timezone.now() - timedelta(seconds=config.liveness_window_s)
    stale = list(
        Agent.objects.filter(
            state__in=[AgentState.LIVE, AgentState.DRAINING], last_heartbeat__lt=cutoff
        ).values_list("id", flat=True)
    )
    reason = liveness_reason(config.heartbeat_interval_s, config.liveness_misses)
    evictions = [e for a in stale if (e := evict_agent(a, reason, stale_before=cutoff))]
    evictions += evict_overdue_drains()
    reclaim_orphaned_work()
    groups.prune_finished()
    return evictions


def evict_overdue_drains() -> list[Eviction]:
    """Evict draining agents past their drain deadline (fleet/routing/drain.py sets it);
    their unfinished work moves on."""
    overdue = Agent.objects.filter(
        state=AgentState.DRAINING, drain_deadline__lt=timezone.now()
    ).values_list("id", "in_flight")
    evictions = []
    for agent_id, in_flight in overdue:
        reason = f"drain deadline passed with {in_flight} task(s) still in flight"
        eviction = evict_agent(agent_id, reason)
        if eviction is not None:
            evictions.append(eviction)
    return evictions


def evict_agent(
    agent_id: uuid.UUID, reason: str, stale_before=None, record: bool = True
) -> Eviction | None:
    """Declare the agent dead (once), record the eviction and reclaim its work.

    ``stale_before``: only if its last heartbeat is still older than this (it may
    have beaten since the sweep looked).  ``record=False`` is a clean exit
    (deregistration): no eviction is written unless work had to be moved.
    Returns the eviction, or None if the agent was already dead (or beat again).
    """
    with transaction.atomic():
        query = Agent.objects.select_for_update().filter(pk=agent_id).exclude(state=AgentState.DEAD)
        if stale_before is not None:
            query = query.filter(last_heartbeat__lt=stale_before)
        agent = query.first()
        if agent is None:
            return None
        in_flight = DeliveryOutbox.objects.filter(agent_id=agent_id, state__in=OPEN_STATES).count()
        Agent.objects.filter(pk=agent_id).update(
            state=AgentState.DEAD, dead_at=timezone.now(), connected_to="", in_flight=0
        )
        affinity.clear_agent(agent_id)  # its bound work binds afresh (reclaim included)
        eviction = None
        if record or in_flight:
            eviction = Eviction.objects.create(
                agent=agent,
                tenant_id=agent.tenant_id,
                agent_name=agent.name,
                last_heartbeat=agent.last_heartbeat,
                in_flight=in_flight,
                reason=reason[:300],
            )
    if eviction is not None:
        log.warning(
            "agent %s (%s) of tenant %s declared dead: %s; %d packet(s) in flight",
            agent.name, agent.id, agent.tenant_id, reason, in_flight,
        )  # fmt: skip
    reclaim_in_flight(agent_id)
    return eviction


def reclaim_in_flight(agent_id: uuid.UUID) -> tuple[int, int]:
    """Move every non-acked row of the dead agent to a survivor; return (moved, left)."""
    rows = list(
        DeliveryOutbox.objects.filter(agent_id=agent_id, state__in=OPEN_STATES)
        .order_by("id")
        .values_list("id", "task_id")
    )
    moved = 0
    for index, (row_id, task_id) in enumerate(rows):
        result = _move_row(row_id, task_id, agent_id)
        if result is None:  # no survivor with room: the rest wait for the next sweep
            left = len(rows) - index
            log.info("agent %s: %d packet(s) wait for a live agent of the tenant", agent_id, left)
            return moved, left
        moved += result
    return moved, 0


def reclaim_orphaned_work() -> int:
    """Retry rows still addressed to dead agents (no survivor had room before)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT DISTINCT o.agent_id FROM delivery_outbox o
            JOIN agents_agent a ON a.id = o.agent_id
            WHERE o.state IN ('pending', 'delivered') AND a.state = 'dead'
            """
        )
        dead = [row[0] for row in cursor.fetchall()]
    return sum(reclaim_in_flight(agent_id)[0] for agent_id in dead)


def _move_row(row_id: int, task_id: uuid.UUID, dead_id: uuid.UUID) -> int | None:
    """Re-address one row; 1 moved, 0 nothing to move (acked meanwhile), None no survivor."""
    with transaction.atomic():
        # Lock order task → outbox row → agent, as the result handler does (workflow → task → …).
        task = (
            TaskExecution.objects.select_for_update()
            .filter(pk=task_id)
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
            .filter(pk=row_id, agent_id=dead_id, state__in=OPEN_STATES)
            .first()
        )
        if row is None or task is None:
            return 0
        if task["status"] != TaskStatus.RUNNING or task["assignment"] != row.assignment:
            # The task moved on without this packet (e.g. declared lost): it is no longer work.
            DeliveryOutbox.objects.filter(pk=row_id).update(
                state=OutboxState.ACKED, acked_at=timezone.now(), updated_at=timezone.now()
            )
            return 0
        package = WorkflowPackage.objects.get(pk=task["workflow_execution__package_id"])
        survivor = _reserve_survivor(task_id, task, runnable_triples(package))
        if survivor is None:
            return None
        artifact = resolve_artifact(package, survivor.target_triple)
        payload = dict(row.payload)
        if artifact is not None:
            payload.update(artifact_digest=artifact.digest, target_triple=artifact.target_triple)
        now = timezone.now()
        DeliveryOutbox.objects.filter(pk=row_id).update(
            agent_id=survivor.id,
            state=OutboxState.PENDING,
            delivered_at=None,
            received_at=None,
            redeliveries=0,  # a new agent gets its own share of pushes
            updated_at=now,
            payload=payload,
            former_agents=[*row.former_agents, str(dead_id)],
        )
        TaskExecution.objects.filter(pk=task_id, assignment=row.assignment).update(
            agent_id=survivor.id, result_deadline=None
        )
        _count_reassigned(dead_id, row.tenant_id)
    log.info("reclaimed packet %s of dead agent %s onto %s", row_id, dead_id, survivor.name)
    return 1


def _reserve_survivor(task_id: uuid.UUID, task: dict, triples):
    """A slot on a live agent that the task's selectors accept (None: none now)."""
    routing = task["routing"] or {}
    if not routing:
        return reserve_agent(task["tenant_id"], triples)
    payload_affinity = str(routing.get("affinity") or "").startswith("payload:")
    try:
        request = selection.request_for(
            task["tenant_id"], routing, task["workflow_execution_id"],
            task["workflow_execution__workflow_name"],
            build_task_context(task_id) if payload_affinity else {},
        )  # fmt: skip
    except SelectorError:  # it was placed once, so this cannot happen; never strand the work
        return reserve_agent(task["tenant_id"], triples)
    outcome = selection.select(
        request, triples, lambda choice: reserve_agent(task["tenant_id"], triples, choice=choice)
    )
    return outcome.agent if isinstance(outcome, selection.Chosen) else None


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
