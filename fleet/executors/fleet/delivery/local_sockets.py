"""This process's agent sockets: agent id → the consumer's channel name and connection generation.

Consumers register here once the agent's ``hello`` is handled; the relay reads
it to know which agents it may push to.  A socket takes packets by a direct call of its
``push`` (the consumer's own coroutine that writes a work frame) on the event loop, and is
closed by its ``close``: no channel-layer message per packet (the in-memory layer deep-
copies each one and wakes the consumer's task to read it back), and no channel-layer
channel per socket at all (a receive task and a queue per socket, thousands of them:
docs/scaling.md, memory).  ``server_id`` is what this process
writes into ``agents_agent.connected_to``.  Everything here runs on the event
loop thread, so no locking is needed.
"""

from __future__ import annotations

import hashlib
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fleet.engine.server_registry import new_instance_id

_server_id: str | None = None


def server_id() -> str:
    """This process's identity in ``connected_to`` (the ServerInstance id under `serve`)."""
    global _server_id
    if _server_id is None:
        _server_id = new_instance_id()
    return _server_id


def set_server_id(value: str) -> None:
    """Adopt the `serve` process's instance id (called by the FleetExecutor)."""
    global _server_id
    _server_id = value


@dataclass(frozen=True)
class LocalSocket:
    agent_id: uuid.UUID
    tenant_id: int
    channel_name: str
    generation: int
    wire_format: str
    key_id: int | None  # the API key the socket was opened with (closed 4401 with it)
    push: Callable[[dict], Awaitable[None]]  # writes one work packet to the socket
    close: Callable[[int, str], Awaitable[None]]  # closes it with a code and a reason


def roster_hash(agent_id: uuid.UUID, generation: int) -> int:
    """A socket's share of :func:`digest`: the first 60 bits of the MD5 of
    ``"<agent id>/<generation>"``, as the relay's ``ROSTER_DIGEST`` computes it in SQL."""
    return int(hashlib.md5(f"{agent_id}/{generation}".encode()).hexdigest()[:15], 16)


_sockets: dict[uuid.UUID, LocalSocket] = {}
# The sum of the sockets' roster_hash, kept as they come and go: the relay compares it with
# the roster's each second instead of sending every socket's id (docs/scaling.md).
_digest = 0
# How many sockets each API key opened: the relay checks each second that those keys are
# still active, without a pass over every socket.
_keys: Counter[int] = Counter()
_listeners: list[Callable[[LocalSocket], None]] = []
_accepting = True  # False once the server stops: new sockets are sent elsewhere (4012)


def accepting() -> bool:
    """Whether this process takes agent sockets (not once it is shutting down)."""
    return _accepting


def stop_accepting() -> None:
    """The server is stopping: every socket opened from now on is closed 4012."""
    global _accepting
    _accepting = False


def register(socket: LocalSocket) -> LocalSocket | None:
    """Record ``socket`` as the agent's live connection; return the one it replaces, if any."""
    global _digest
    previous = _sockets.get(socket.agent_id)
    _sockets[socket.agent_id] = socket
    _digest += roster_hash(socket.agent_id, socket.generation)
    _count_key(socket.key_id, 1)
    if previous is not None:
        _digest -= roster_hash(previous.agent_id, previous.generation)
        _count_key(previous.key_id, -1)
    for listener in list(_listeners):
        listener(socket)
    return previous if previous and previous.channel_name != socket.channel_name else None


def unregister(agent_id: uuid.UUID, channel_name: str) -> bool:
    """Forget the agent's socket, but only if it is still this channel (not a newer one)."""
    global _digest
    current = _sockets.get(agent_id)
    if current is not None and current.channel_name == channel_name:
        del _sockets[agent_id]
        _digest -= roster_hash(agent_id, current.generation)
        _count_key(current.key_id, -1)
        return True
    return False


def digest() -> tuple[int, int]:
    """How many sockets this process holds and the sum of their :func:`roster_hash`: equal
    to the roster's (the agents it says are connected here, and their generations) when
    every socket here is one the roster backs and the roster backs no other."""
    return len(_sockets), _digest


def _count_key(key_id: int | None, change: int) -> None:
    if key_id is None:
        return
    _keys[key_id] += change
    if not _keys[key_id]:
        del _keys[key_id]


def key_ids() -> set[int]:
    """The API keys the sockets here were opened with."""
    return set(_keys)


def get(agent_id: uuid.UUID) -> LocalSocket | None:
    return _sockets.get(agent_id)


def snapshot() -> dict[uuid.UUID, LocalSocket]:
    return dict(_sockets)


def on_register(listener: Callable[[LocalSocket], None]) -> None:
    """Call ``listener`` whenever an agent socket registers (the relay wakes up)."""
    if listener not in _listeners:
        _listeners.append(listener)


def remove_listener(listener: Callable[[LocalSocket], None]) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def clear() -> None:
    """Forget every socket and take sockets again (tests)."""
    global _accepting, _digest
    _sockets.clear()
    _keys.clear()
    _digest = 0
    _accepting = True
