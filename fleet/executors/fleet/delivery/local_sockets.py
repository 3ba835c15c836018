"""This process's agent sockets: agent id → the consumer's channel name and connection generation.

Consumers register here once the agent's ``hello`` is handled; the relay reads
it to know which agents it may push to.  A socket registered with ``push`` (the
consumer's own coroutine that writes a work frame) takes packets by a direct call
on the event loop: no channel-layer message per packet (the in-memory layer deep-
copies each one and wakes the consumer's task to read it back).  One registered with
``close`` is closed the same way (:func:`send_close`); the delivery consumer registers
both and holds no channel-layer channel at all (a receive task and a queue per socket,
thousands of them: docs/scaling.md, memory).  ``server_id`` is what this process
writes into ``agents_agent.connected_to``.  Everything here runs on the event
loop thread, so no locking is needed.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

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
    key_id: int | None = None  # the API key the socket was opened with (closed 4401 with it)
    # Writes one work packet to the socket (the consumer's); None: send over the channel layer.
    push: Callable[[dict], Awaitable[None]] | None = None
    # Closes the socket with a code and a reason (the consumer's); None: a ``delivery.close``
    # message over the channel layer.
    close: Callable[[int, str], Awaitable[None]] | None = None


_sockets: dict[uuid.UUID, LocalSocket] = {}
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
    previous = _sockets.get(socket.agent_id)
    _sockets[socket.agent_id] = socket
    for listener in list(_listeners):
        listener(socket)
    return previous if previous and previous.channel_name != socket.channel_name else None


def unregister(agent_id: uuid.UUID, channel_name: str) -> bool:
    """Forget the agent's socket, but only if it is still this channel (not a newer one)."""
    current = _sockets.get(agent_id)
    if current is not None and current.channel_name == channel_name:
        del _sockets[agent_id]
        return True
    return False


async def send_close(socket: LocalSocket, code: int, reason: str, layer: Any) -> None:
    """Close ``socket`` with ``code``: a direct call when its consumer registered one, else a
    ``delivery.close`` message on ``layer`` (the caller's channel layer; raises ChannelFull
    as the layer does)."""
    if socket.close is not None:
        await socket.close(code, reason)
        return
    await layer.send(
        socket.channel_name, {"type": "delivery.close", "code": code, "reason": reason}
    )


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
    global _accepting
    _sockets.clear()
    _accepting = True
