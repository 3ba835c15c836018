"""Large task contexts travel by reference: over REST, not inside the work packet.

A WebSocket frame of the delivery protocol is at most 1 MiB (docs/agent-protocol.md).
A packet whose ``context_json`` would not fit carries ``context_ref`` instead —
``{"bytes": N, "sha256": "…"}`` of the exact text — and the agent fetches the text
with ``GET /api/v1/agents/{its id}/tasks/{task_execution_id}/context?assignment=N``,
which is answered only for the agent the packet is addressed to, in its own tenant,
while that assignment is the task's current run.  The server rebuilds the text with
the shared context builder: a Ready task's inputs (its execution's input and its
upstream outputs) never change, so the bytes are those the packet was sized for —
the agent checks the digest anyway.

Contexts over ``CLOACINA_MAX_CONTEXT_BYTES`` are not sent at all: the task fails with
``ContextTooLarge`` naming both sizes.
"""

from __future__ import annotations

import hashlib
import json
import uuid

from django.db import connection

from fleet.engine.context import build_task_context, encode_context
from fleet.executors.fleet.state import ledger
from fleet.platform.config import get_config

FRAME_LIMIT_BYTES = 1024 * 1024  # the protocol's frame limit
# Room for the rest of the packet (ids, function, digest, …) and the frame envelope.
PACKET_HEADROOM_BYTES = 16 * 1024
INLINE_MAX_BYTES = FRAME_LIMIT_BYTES - PACKET_HEADROOM_BYTES


def too_large(context_json: str, max_bytes: int) -> str:
    """The error message when the context is over ``max_bytes``; '' when it is not."""
    size = len(context_json.encode())
    if size <= max_bytes:
        return ""
    return (
        f"the task's input context is {size} bytes, over the {max_bytes}-byte limit "
        "(CLOACINA_MAX_CONTEXT_BYTES): its upstream outputs together are too large"
    )


def inline_size(context_json: str) -> int:
    """Bytes ``context_json`` takes inside a JSON frame (as an escaped string)."""
    if 6 * len(context_json) + 2 <= INLINE_MAX_BYTES:
        return 6 * len(context_json) + 2  # an upper bound: no character escapes to more
    return len(json.dumps(context_json, ensure_ascii=False).encode())


def reference(context_json: str) -> dict:
    data = context_json.encode()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def packet_context(payload: dict, context_json: str) -> dict:
    """``payload`` as it should travel: unchanged, or with ``context_ref`` for a context
    too large for a frame (``context_json`` removed)."""
    if inline_size(context_json) <= INLINE_MAX_BYTES:
        return payload
    by_ref = {k: v for k, v in payload.items() if k != "context_json"}
    by_ref["context_ref"] = reference(context_json)
    return by_ref


_OPEN_PACKET = f"""
SELECT EXISTS (SELECT 1 FROM {ledger.AGENTS} WHERE id = %(agent)s AND tenant_id = %(tenant)s),
       EXISTS (
           SELECT 1 FROM {ledger.OUTBOX} o
           JOIN fleet_taskexecution t ON t.id = o.task_execution_id
           WHERE o.task_execution_id = %(task)s AND o.assignment = %(assignment)s
             AND o.agent_id = %(agent)s AND o.tenant_id = %(tenant)s AND {ledger.open_row("o")}
             AND t.status = 'Running' AND t.assignment = o.assignment
       )
"""


def serve_context(
    tenant_id: int, agent_id: uuid.UUID, task_execution_id: uuid.UUID, assignment: int
) -> tuple[int, str]:
    """(200, the context text) for the agent an open packet of that run is addressed to;
    else (404 / 413, why).  Another tenant's agent or task is answered like a missing one."""
    with connection.cursor() as cursor:
        cursor.execute(
            _OPEN_PACKET,
            {"agent": agent_id, "tenant": tenant_id, "task": task_execution_id,
             "assignment": assignment},
        )  # fmt: skip
        known_agent, addressed = cursor.fetchone()
    if not known_agent:
        return 404, "unknown agent"
    if not addressed:
        return 404, (
            f"no open work packet of task {task_execution_id} (assignment {assignment}) "
            "is addressed to this agent"
        )
    text = encode_context(build_task_context(task_execution_id))
    oversize = too_large(text, get_config().max_context_bytes)
    if oversize:
        return 413, oversize
    return 200, text
