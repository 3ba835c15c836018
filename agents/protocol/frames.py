"""The frames the agent sends on the delivery WebSocket (docs/agent-protocol.md).

Encoding and decoding are :mod:`agents.protocol.wire`'s, shared with the server.
"""

from __future__ import annotations

from typing import Any


def hello(holding: list[tuple[str, int]]) -> dict[str, Any]:
    return {"type": "hello", "holding": [[teid, assignment] for teid, assignment in holding]}


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
