"""Draining an agent on request (``POST /api/v1/agents/{id}/drain``, the console button).

A drain marks the agent ``draining`` — no new work is placed on it — and sets
``drain_requested_at``, so its next heartbeat is answered with the ``drain`` frame (or
``drain: true`` over REST).  In protocol 1 that frame means "take no more work, finish
and report what you hold, deregister, exit" (docs/agent.md), so the agent itself lets
its in-flight work finish and then leaves.  The server bounds the wait: an agent still
not gone at ``drain_deadline`` is evicted by the liveness sweep
(:func:`fleet.delivery.liveness.evict_overdue_drains`), which moves its unfinished work to other agents exactly
as for a dead one.  ``runagent`` drains the same way on its own on SIGTERM.

Bindings (groups, affinity) to a draining agent are cleared at once: their next task
binds to an agent that stays.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import connection
from django.utils import timezone

from agents.models import Agent
from fleet.errors import DomainError, ErrorKind
from fleet.routing import affinity

log = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 300.0
MAX_DRAIN_TIMEOUT_S = 7 * 24 * 3600.0


class DrainRefused(DomainError):
    """The agent cannot be drained (``kind``: invalid timeout or a dead agent)."""


@dataclass(frozen=True)
class Drain:
    agent_id: uuid.UUID
    name: str
    state: str
    in_flight: int
    drain_deadline: datetime | None


def request_drain(agent_id: uuid.UUID, timeout_s: float, actor: str) -> Drain:
    """Mark the agent draining with a deadline ``timeout_s`` from now (an earlier one
    already set is kept); 409 for a dead agent.  Tenant checks are the caller's."""
    if not 0 < timeout_s <= MAX_DRAIN_TIMEOUT_S:
        raise DrainRefused(
            ErrorKind.INVALID, f"timeout_s must be in (0, {MAX_DRAIN_TIMEOUT_S:g}], got {timeout_s}"
        )
    deadline = timezone.now() + timedelta(seconds=timeout_s)
    with connection.cursor() as cursor:
        cursor.execute(
            """
            UPDATE agents_agent SET state = 'draining',
                drain_requested_at = coalesce(drain_requested_at, now()),
                drain_deadline = LEAST(coalesce(drain_deadline, %s), %s)
            WHERE id = %s AND state IN ('live', 'draining')
            RETURNING id, name, state, in_flight, drain_deadline
            """,
            [deadline, deadline, agent_id],
        )
        row = cursor.fetchone()
    if row is None:
        name = Agent.objects.filter(pk=agent_id).values_list("name", flat=True).first()
        raise DrainRefused(
            ErrorKind.CONFLICT, f"agent {name or agent_id} is dead: there is nothing to drain"
        )
    drain = Drain(*row)
    affinity.clear_agent(agent_id)
    log.info(
        "agent %s drained by %s: %d task(s) in flight, deadline %s",
        drain.name, actor, drain.in_flight, drain.drain_deadline.isoformat(),
    )  # fmt: skip
    return drain
