"""The durable push queue to agents and the eviction record of dead agents."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class OutboxState(models.TextChoices):
    PENDING = "pending"  # waiting to be pushed to its agent
    DELIVERED = "delivered"  # pushed over the agent's WebSocket, outcome not yet recorded
    ACKED = "acked"  # the agent's outcome for it is recorded: no longer in flight


class DeliveryOutbox(models.Model):
    """One work packet addressed to one agent (table ``delivery_outbox``)."""

    tenant = models.ForeignKey("fleet.Tenant", on_delete=models.CASCADE, related_name="outbox_rows")
    # No index of their own: outbox_agent_state_idx leads with the agent and
    # one_packet_per_assignment with the task; a packet's state changes (delivered, acked)
    # are non-HOT updates that write an entry into every index.
    agent = models.ForeignKey(
        "agents.Agent", on_delete=models.CASCADE, related_name="outbox_rows", db_index=False
    )
    task_execution = models.ForeignKey(
        "fleet.TaskExecution", on_delete=models.CASCADE, related_name="outbox_rows", db_index=False
    )
    assignment = models.PositiveIntegerField()
    state = models.CharField(
        max_length=10, choices=OutboxState.choices, default=OutboxState.PENDING
    )
    payload = models.JSONField()
    attempts = models.PositiveIntegerField(default=0)  # pushes so far
    # Pushes to the current agent that went unconfirmed (reset when the row moves to
    # another agent): past CLOACINA_OUTBOX_MAX_PUSHES the run is declared lost.
    redeliveries = models.PositiveIntegerField(default=0, db_default=0)
    created_at = models.DateTimeField(default=timezone.now)
    delivered_at = models.DateTimeField(null=True, blank=True)
    received_at = models.DateTimeField(
        null=True, blank=True
    )  # the agent confirmed it holds the packet
    acked_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)
    # Agents this packet was reclaimed from (ids as text): their late results are
    # recorded, not rejected as "never addressed to this agent".
    former_agents = models.JSONField(default=list, blank=True)

    class Meta:
        db_table = "delivery_outbox"
        indexes = [
            models.Index(fields=["agent", "state"], name="outbox_agent_state_idx"),
            models.Index(fields=["state", "updated_at"], name="outbox_state_age_idx"),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["task_execution", "assignment"], name="one_packet_per_assignment"
            ),
        ]


class Eviction(models.Model):
    """An agent the liveness sweeper declared dead, and the work it reclaimed."""

    agent = models.ForeignKey("agents.Agent", on_delete=models.CASCADE, related_name="evictions")
    tenant = models.ForeignKey("fleet.Tenant", on_delete=models.CASCADE, related_name="evictions")
    agent_name = models.CharField(max_length=200)
    evicted_at = models.DateTimeField(default=timezone.now)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    in_flight = models.PositiveIntegerField(default=0)
    reassigned = models.PositiveIntegerField(default=0)
    reason = models.CharField(max_length=300)

    class Meta:
        ordering = ["-evicted_at"]
        indexes = [models.Index(fields=["tenant", "evicted_at"])]
