"""The delivery WebSocket's frames (docs/agent-protocol.md): JSON text or MessagePack binary."""

from __future__ import annotations

import json
from typing import Any

import msgpack

WIRE_FORMATS = ("json", "msgpack")


class FrameError(ValueError):
    """A frame from the server that is not a JSON/MessagePack object with a string ``type``."""


def encode(frame: dict[str, Any], wire_format: str) -> str | bytes:
    """A frame ready for ``websocket.send`` (text for json, binary for msgpack)."""
    if wire_format == "msgpack":
        return msgpack.packb(frame, use_bin_type=True)
    return json.dumps(frame, separators=(",", ":"))


def decode(message: str | bytes) -> dict[str, Any]:
    """Parse a received frame; the server may send either kind regardless of what we asked."""
    try:
        if isinstance(message, bytes):
            frame = msgpack.unpackb(message, raw=False)
        else:
            frame = json.loads(message)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise FrameError(f"unreadable frame: {exc}") from None
    if not isinstance(frame, dict) or not isinstance(frame.get("type"), str):
        raise FrameError("frame is not an object with a string 'type'")
    return frame


def hello(holding: list[tuple[str, int]]) -> dict[str, Any]:
    return {"type": "hello", "holding": [[teid, assignment] for teid, assignment in holding]}


def received(outbox_id: int) -> dict[str, Any]:
    return {"type": "received", "outbox_id": outbox_id}


def heartbeat(
    in_flight: int, running: list[str], metrics: dict[str, Any], draining: bool
) -> dict[str, Any]:
    # ``running`` and ``draining`` are additive fields (protocol v1 servers may ignore them).
    return {
        "type": "heartbeat",
        "in_flight": in_flight,
        "running": running,
        "metrics": metrics,
        "draining": draining,
    }
