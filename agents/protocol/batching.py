"""Grouping frames that are ready together into ``batch`` frames (docs/agent-protocol.md,
"Batched frames").

Both sides queue the frames they produce in one event-loop turn and send them at the
start of the next one.  :func:`pack` decides how they travel: each alone when the peer
did not ask for batches or a frame has no company, else as few ``batch`` frames as the
bounds allow (:data:`~agents.protocol.frames.MAX_BATCH_FRAMES` frames, and
:data:`~agents.protocol.frames.MAX_BATCH_BYTES` bytes, a frame's own limit).  A frame
too large to share a batch goes alone, as it would have before.

DB-free and I/O-free: imported by the agent runtime and by the server alike.
"""

from __future__ import annotations

from agents.protocol import frames, wire

Encoded = str | bytes


def frame_bytes(data: Encoded) -> int:
    """``data``'s size on the wire (a text frame travels as UTF-8)."""
    if isinstance(data, str):
        return len(data) if data.isascii() else len(data.encode())
    return len(data)


def pack(
    encoded: list[Encoded],
    fmt: str,
    batch: bool,
    max_frames: int = frames.MAX_BATCH_FRAMES,
    max_bytes: int = frames.MAX_BATCH_BYTES,
) -> list[Encoded]:
    """The frames to send for ``encoded`` (frames :func:`wire.encode` made, in order):
    the same frames when ``batch`` is off or there is one, else ``batch`` frames of at
    most ``max_frames`` frames and ``max_bytes`` bytes each, order kept."""
    if not batch or len(encoded) < 2:
        return list(encoded)
    out: list[Encoded] = []
    group: list[Encoded] = []
    size = wire.BATCH_OVERHEAD_BYTES
    for data in encoded:
        cost = frame_bytes(data) + 1  # a JSON comma; msgpack adds nothing per frame
        if group and (len(group) >= max_frames or size + cost > max_bytes):
            out.append(_one(group, fmt))
            group, size = [], wire.BATCH_OVERHEAD_BYTES
        group.append(data)
        size += cost
    out.append(_one(group, fmt))
    return out


def _one(group: list[Encoded], fmt: str) -> Encoded:
    # A frame alone travels as itself: byte for byte what an unbatched peer would send.
    return group[0] if len(group) == 1 else wire.join_frames(group, fmt)  # type: ignore[arg-type]
