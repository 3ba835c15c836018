"""Agent selection records: affinity/group bindings and agent event counters."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class BindingKind(models.TextChoices):
    GROUP = "group"  # the tasks of one group in one execution share an agent
    DEFINITION = "definition"  # every execution of a workflow (affinity = "definition")
    PAYLOAD = "payload"  # executions with the same context value (affinity = "payload:<key>")


class AffinityBinding(models.Model):
    """Work keyed by ``key`` goes to ``agent`` while it lives (fleet/executors/fleet/routing/affinity.py).

    Cleared when the agent dies (liveness sweep) or drains; a group binding goes with
    its execution.
    """

    tenant = models.ForeignKey(
        "fleet.Tenant", on_delete=models.CASCADE, related_name="affinity_bindings"
    )
    kind = models.CharField(max_length=10, choices=BindingKind.choices)
    key = models.CharField(max_length=400)
    agent = models.ForeignKey(
        "agents.Agent", on_delete=models.CASCADE, related_name="affinity_bindings"
    )
    workflow_execution = models.ForeignKey(
        "fleet.WorkflowExecution",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="group_bindings",
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "key"], name="one_binding_per_key"),
        ]
        indexes = [models.Index(fields=["agent"], name="binding_agent_idx")]

    def __str__(self) -> str:
        return f"{self.key} → {self.agent_id}"


class AgentEventCount(models.Model):
    """Cluster-wide counts of agent events, kept by a trigger on ``agents_agent``
    (migration 0006): state changes (from → to), connects and disconnects.

    A trigger sees every path that changes an agent (REST, sockets, sweeps, actuators),
    and every server process scrapes the same totals.
    """

    kind = models.CharField(max_length=16)  # state_change | connect | disconnect
    from_state = models.CharField(max_length=10, blank=True, default="")
    to_state = models.CharField(max_length=10, blank=True, default="")
    count = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["kind", "from_state", "to_state"], name="one_agent_event_counter"
            ),
        ]
