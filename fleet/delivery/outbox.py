"""Enqueueing work packets into ``delivery_outbox`` (states: pending → delivered → acked).

A row is written in the dispatch transaction, together with the claim and
the agent's slot reservation; its insert fires the ``delivery_outbox``
NOTIFY (a trigger, delivered only after commit) that wakes the relay of the
server process holding the agent's socket.  The packet's ``outbox_id`` is
added by the relay at push time (the row id does not exist before insert).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from fleet.engine.claims import Claim
from fleet.models import DeliveryOutbox, TaskExecution

PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class PackageRef:
    """What a packet needs to know about the package that runs the task."""

    digest: str
    kind: str
    target_triple: str  # the triple the shipped artifact was built for (python: the agent's)


def work_packet(claim: Claim, context_json: str, package: PackageRef, tenant_name: str) -> dict:
    """The packet per docs/agent-protocol.md, without ``outbox_id`` (added at push)."""
    return {
        "task_execution_id": str(claim.task_execution_id),
        "assignment": claim.assignment,
        "attempt": claim.attempt,
        "workflow_execution_id": str(claim.workflow_execution_id),
        "task_name": claim.task_name,
        "function": claim.function,
        "context_json": context_json,
        "artifact_digest": package.digest,
        "package_kind": package.kind,
        "target_triple": package.target_triple,
        "timeout_s": float(claim.timeout_s),
        "tenant": tenant_name,
    }


def enqueue(claim: Claim, agent_id: uuid.UUID, payload: dict) -> DeliveryOutbox:
    """Insert the packet addressed to ``agent_id`` and record the agent on the task.

    Call inside the dispatch transaction, after the slot was reserved.
    """
    row = DeliveryOutbox.objects.create(
        tenant_id=claim.tenant_id,
        agent_id=agent_id,
        task_id=claim.task_execution_id,
        assignment=claim.assignment,
        payload=payload,
    )
    TaskExecution.objects.filter(pk=claim.task_execution_id, assignment=claim.assignment).update(
        agent_id=agent_id
    )
    return row
