"""The work packet an outbox row carries (states: pending → delivered → acked).

A row is written in the dispatch transaction, together with the claim and
the agent's slot reservation (:mod:`fleet.executors.fleet.delivery.placement`, from the ledger's
statements); its insert fires the outbox NOTIFY (a trigger, delivered only after
commit) that wakes the relay of the server process holding the agent's socket.
The packet's ``outbox_id`` is added by the relay at push time (the row id does not
exist before insert).
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.engine.claims import Claim

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
