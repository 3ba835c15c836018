"""Enqueueing work packets into ``delivery_outbox`` (states: pending → delivered → acked).

A row is written in the dispatch transaction, together with the claim and
the agent's slot reservation; its insert fires the ``delivery_outbox``
NOTIFY (a trigger, delivered only after commit) that wakes the relay of the
server process holding the agent's socket.  The packet's ``outbox_id`` is
added by the relay at push time (the row id does not exist before insert).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from fleet.engine.claims import Claim
from fleet.routing.reservation import ReservedAgent, reserve_agent
from fleet.routing.selectors import Choice

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


_ENQUEUE_ON_RESERVED = """
, packet AS (
    INSERT INTO delivery_outbox (tenant_id, agent_id, task_id, assignment, state, payload,
                                 attempts, created_at, updated_at, former_agents)
    SELECT %(o_tenant)s, r.id, %(o_task)s, %(o_assignment)s, 'pending',
           %(o_payload)s::jsonb || jsonb_build_object(
               'target_triple', r.target_triple,
               'artifact_digest', coalesce(%(o_digests)s::jsonb ->> r.target_triple, %(o_digest)s)
           ),
           0, now(), now(), '[]'::jsonb
    FROM reserved r
    RETURNING agent_id
), assigned AS (
    UPDATE fleet_taskexecution t SET agent_id = p.agent_id FROM packet p
    WHERE t.id = %(o_task)s AND t.assignment = %(o_assignment)s
)
, relax AS (
    -- The dispatch need not survive a database crash on its own (a lost one leaves the
    -- task Ready: it runs again); the outcome's synchronous commit flushes it anyway.
    SELECT set_config('synchronous_commit', 'off', true)
)
SELECT id, name, target_triple FROM reserved, relax
"""


def enqueue_on_best_agent(
    claim: Claim,
    payload: dict,
    triples: Iterable[str] | None,
    digest: str,
    digests_by_triple: dict[str, str] | None = None,
    choice: Choice | None = None,
) -> ReservedAgent | None:
    """Reserve a slot on the best agent and insert the packet addressed to it, in ONE
    statement (inside the dispatch transaction); None when no agent has room.

    The packet is stamped with the chosen agent's triple and the digest built for
    it (``digests_by_triple``; else ``digest``).  One statement matters: the
    agent's row stays locked from the reservation to the commit, and every other
    dispatch, result and heartbeat of that agent waits for it.  ``choice``: the
    task's compiled selectors (:mod:`fleet.routing.selectors`; None: none).
    """
    return reserve_agent(
        claim.tenant_id,
        triples,
        then_sql=_ENQUEUE_ON_RESERVED,
        then_params={
            "o_tenant": claim.tenant_id,
            "o_task": claim.task_execution_id,
            "o_assignment": claim.assignment,
            "o_payload": json.dumps(payload),
            "o_digests": json.dumps(digests_by_triple or {}),
            "o_digest": digest,
        },
        choice=choice,
    )
