"""How the agent's delivery session writes the frames it queues (agents/runtime/connection.py,
``Session.send_soon``): a socket that pushes back, or one that breaks, is handled as the
awaited ``ws.send`` handles it (a real socket: tests/integration/test_agent_session_writes.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from websockets.protocol import State

from agents.protocol import frames, wire
from agents.runtime.connection import Session
from tests.support.loop import run_async


def _received(outbox_id: int) -> bytes:
    return wire.encode(frames.received(outbox_id), "msgpack")  # type: ignore[return-value]


class _ProtocolSocket:
    """A client end with websockets' sans-I/O protocol side, as the session's callback uses
    it: ``written`` is what reached the transport, ``awaited`` what went through ``send``."""

    def __init__(self, fail: bool = False) -> None:
        self.paused = False
        self.send_in_progress = None
        self.fail = fail
        self._pending: list[bytes] = []
        self.written: list[bytes] = []
        self.awaited: list[bytes] = []
        self.aborted = False
        self.protocol = SimpleNamespace(
            state=State.OPEN, send_binary=self._pending.append, send_text=self._pending.append
        )
        self.transport = SimpleNamespace(abort=self._abort)

    def _abort(self) -> None:
        self.aborted = True

    def send_data(self) -> None:
        if self.fail:
            raise OSError("connection reset")
        self.written.extend(self._pending)
        self._pending.clear()

    async def send(self, data: bytes) -> None:
        await asyncio.sleep(0)  # a full buffer drains
        self.awaited.append(data)


def test_a_socket_that_pushes_back_gets_the_awaited_send_and_the_order_is_kept():
    async def scenario() -> _ProtocolSocket:
        ws = _ProtocolSocket()
        session = Session(ws, "msgpack", batch_frames=False)  # type: ignore[arg-type]
        ws.paused = True  # its write buffer is over the high-water mark
        session.send_soon(_received(1))
        await asyncio.sleep(0)
        session.send_soon(_received(2))  # queued while the awaited flush runs: after 1
        ws.paused = False
        for _ in range(10):
            await asyncio.sleep(0)
        session.send_soon(_received(3))  # the buffer drained: the callback writes again
        for _ in range(3):
            await asyncio.sleep(0)
        return ws

    ws = run_async(scenario())
    assert ws.awaited == [_received(1), _received(2)]
    assert ws.written == [_received(3)]


def test_a_write_that_fails_closes_the_session_and_aborts_the_socket():
    async def scenario() -> tuple[_ProtocolSocket, Session]:
        ws = _ProtocolSocket(fail=True)
        session = Session(ws, "msgpack", batch_frames=True)  # type: ignore[arg-type]
        session.send_soon(_received(1))
        for _ in range(3):
            await asyncio.sleep(0)
        return ws, session

    ws, session = run_async(scenario())
    assert session.closed and ws.aborted
    assert not session.send_soon(_received(2))  # the caller reports it another way
