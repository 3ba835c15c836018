"""Agents for tests: the one factory for agent rows, and reading the roster back.

Agents made here are rows only (no process): ``connected=True`` marks them as holding a
delivery socket on this test process, which is what dispatch needs.  The real agent
processes are started by :func:`tests.support.processes.start_agent`.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

# What a routing test's agent reports unless it says otherwise: room for anything.
IDLE = {"free_cpu_pct": 90.0, "memory_free_pct": 80.0, "free_memory_mb": 8000}


def make_agent(
    tenant,
    name: str | None = None,
    *,
    max_concurrency: int = 2,
    connected: bool | str = True,
    state: str = "live",
    triple: str | None = None,
    heartbeat_age_s: float = 0.0,
    in_flight: int = 0,
    tags: tuple | list = (),
    capabilities: tuple | list = (),
    metrics: dict | None = None,
    exclusive: bool = False,
    **fields,
):
    """An agent row of ``tenant``.

    ``connected`` is True (a socket on this test process), False (none) or the id of the
    server holding its socket.  ``metrics`` None keeps the model's default (nothing
    reported).  Any other Agent field (``last_heartbeat``, ``dead_at``, ``version`` …) may
    be given as a keyword and wins over the values derived above.
    """
    from django.utils import timezone

    from agents.models import Agent
    from agents.protocol.triples import host_triple
    from fleet.executors.fleet.delivery import local_sockets

    if connected is True:
        connected = local_sockets.server_id()
    row = {
        "tenant": tenant,
        "name": name or f"agent-{uuid.uuid4().hex[:6]}",
        "state": state,
        "target_triple": triple or host_triple(),
        "max_concurrency": max_concurrency,
        "in_flight": in_flight,
        "connected_to": connected or "",
        "last_heartbeat": timezone.now() - timedelta(seconds=heartbeat_age_s),
        "tags": list(tags),
        "capabilities": list(capabilities),
        "exclusive": exclusive,
    }
    if metrics is not None:
        row["metrics"] = metrics
    return Agent.objects.create(**{**row, **fields})


def live_agents(tenant) -> list:
    """``tenant``'s live agents, by name."""
    from agents.models import Agent

    return list(Agent.objects.filter(tenant=tenant, state="live").order_by("name"))


def seq_of(name: str) -> int:
    """proc-<server pid>-<n> → n (the process actuator's start order)."""
    return int(name.rsplit("-", 1)[1])


def pid_of(name: str) -> int:
    """proc-<server pid>-<n> → the pid of the server that started the agent."""
    return int(name.split("-")[1])
