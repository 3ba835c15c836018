"""The agent roster (server side; the DB-less runtime lives in agents/runtime/)."""

from __future__ import annotations

import uuid

from django.db import models
from django.utils import timezone


class AgentState(models.TextChoices):
    LIVE = "live"
    DRAINING = "draining"
    DEAD = "dead"  # evicted: silent past the liveness window, overdue drain, revoked key
    STOPPED = "stopped"  # a clean exit: deregistered (SIGTERM, a deprovision's drain)


# The states an agent never leaves (a new registration is a new row).
ENDED_STATES = (AgentState.DEAD, AgentState.STOPPED)
# The states that hold a name, a socket and (draining: finishing) work.
ACTIVE_STATES = (AgentState.LIVE, AgentState.DRAINING)


class Agent(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey("fleet.Tenant", on_delete=models.CASCADE, related_name="agents")
    api_key = models.ForeignKey(
        "fleet.ApiKey", null=True, blank=True, on_delete=models.SET_NULL, related_name="agents"
    )
    name = models.CharField(max_length=200)
    state = models.CharField(max_length=10, choices=AgentState.choices, default=AgentState.LIVE)
    target_triple = models.CharField(max_length=100)
    max_concurrency = models.PositiveIntegerField(default=1)
    in_flight = models.PositiveIntegerField(
        default=0
    )  # reserved slots, changed atomically by dispatch/result
    version = models.CharField(max_length=50, blank=True, default="")
    protocol_version = models.PositiveIntegerField(default=1)
    wire_format = models.CharField(max_length=10, default="json")
    tags = models.JSONField(default=list, blank=True)
    capabilities = models.JSONField(default=list, blank=True)
    exclusive = models.BooleanField(default=False)
    metrics = models.JSONField(default=dict, blank=True)
    registered_at = models.DateTimeField(default=timezone.now)
    last_heartbeat = models.DateTimeField(default=timezone.now)
    # Which server process holds this agent's delivery socket ('' = none), and a
    # generation counter so a stale disconnect never clears a fresh connection.
    connected_to = models.CharField(max_length=100, blank=True, default="")
    connection_generation = models.PositiveIntegerField(default=0)
    drain_requested_at = models.DateTimeField(null=True, blank=True)
    # A drain asked through the API/console: past this the sweep evicts the agent and
    # moves its unfinished work (fleet/executors/fleet/lifecycle.py).  Null: no deadline.
    drain_deadline = models.DateTimeField(null=True, blank=True)
    # When a reservation last picked it: selection round-robins on it (fleet/executors/fleet/routing/).
    last_selected_at = models.DateTimeField(null=True, blank=True)
    # When it ended (dead or stopped).
    dead_at = models.DateTimeField(null=True, blank=True)
    # Its circuit breaker (owner: fleet/executors/fleet/state/breaker.py): consecutive
    # failures since the last success; open until ``breaker_open_until`` (NULL: closed;
    # past: half-open, one probe placed when ``breaker_probing``); ``breaker_trips``: times
    # it opened in a row without closing (the cool-off doubles with each).
    breaker_failures = models.PositiveIntegerField(default=0)
    breaker_open_until = models.DateTimeField(null=True, blank=True)
    breaker_probing = models.BooleanField(default=False)
    breaker_trips = models.PositiveIntegerField(default=0)
    # The agent process's own id (sent at registration): a process that re-registers
    # under a new agent id keeps it, so its outcomes owed under the old id still count.
    instance_id = models.UUIDField(null=True, blank=True)
    managed_by = models.CharField(
        max_length=20, blank=True, default=""
    )  # actuator that spawned it, if any

    class Meta:
        ordering = ["tenant", "name"]
        indexes = [
            models.Index(fields=["tenant", "state"]),
            models.Index(fields=["state", "last_heartbeat"]),
        ]
        constraints = [
            # One live or draining agent per name in a tenant; ended ones stay for history.
            models.UniqueConstraint(
                fields=["tenant", "name"],
                condition=models.Q(state__in=["live", "draining"]),
                name="uniq_live_agent_name",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.state})"
