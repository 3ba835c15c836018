"""The frames the agent sends on the delivery WebSocket (docs/agent-protocol.md).

Encoding and decoding are :mod:`agents.protocol.wire`'s, shared with the server.
"""

from __future__ import annotations

from typing import Any

# Batched frames (docs/agent-protocol.md, "Batched frames"): a ``batch`` frame carries
# frames of these kinds, each as it would travel alone.  An agent batches its frames only
# to a server whose registration answered ``batch_frames: true``; a server batches its
# frames only to a socket whose hello said ``batch_frames: true``.
AGENT_BATCHABLE = frozenset({"received", "result"})
SERVER_BATCHABLE = frozenset({"work", "result_ack"})
MAX_BATCH_FRAMES = 256  # frames in one batch, either way
MAX_BATCH_BYTES = 1024 * 1024  # a whole batch frame: the server's limit on any frame


def hello(holding: list[tuple[str, int]], batch_frames: bool = False) -> dict[str, Any]:
    """``batch_frames``: this agent takes ``batch`` frames from the server."""
    frame: dict[str, Any] = {
        "type": "hello",
        "holding": [[teid, assignment] for teid, assignment in holding],
    }
    if batch_frames:
        frame["batch_frames"] = True
    return frame


def received(outbox_id: int) -> dict[str, Any]:
    return {"type": "received", "outbox_id": outbox_id}


def log_chunk(
    task_execution_id: str, assignment: int, text: str, end: int, skipped: int = 0
) -> dict[str, Any]:
    """A running task's new output, for live tailing (no answer; the outcome carries the
    whole log): ``text`` ends at byte ``end`` of the attempt's output, ``skipped`` bytes
    before it were dropped from the agent's bounded ring."""
    return {
        "type": "log",
        "task_execution_id": task_execution_id,
        "assignment": assignment,
        "text": text,
        "bytes": end,
        "skipped": skipped,
    }


def heartbeat(
    in_flight: int, running: list[str], metrics: dict[str, Any], draining: bool
) -> dict[str, Any]:
    return {
        "type": "heartbeat",
        "in_flight": in_flight,
        "running": running,
        "metrics": metrics,
        "draining": draining,
    }
