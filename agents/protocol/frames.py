"""The frames the agent sends on the delivery WebSocket (docs/agent-protocol.md).

Encoding and decoding are :mod:`agents.protocol.wire`'s, shared with the server.
"""

from __future__ import annotations

from typing import Any


def hello(holding: list[tuple[str, int]]) -> dict[str, Any]:
    return {"type": "hello", "holding": [[teid, assignment] for teid, assignment in holding]}


def received(outbox_id: int) -> dict[str, Any]:
    return {"type": "received", "outbox_id": outbox_id}


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
