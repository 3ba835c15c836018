"""The agent's delivery socket hands each whole message to the session's handler as the
socket parses it (agents/runtime/connection.FrameConnection), with a real WebSocket
server: no task step in between, the server's order kept across fragmented messages,
and bad frames refused as before (docs/performance.md, "Round i17-recv")."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import pytest
from websockets.asyncio.server import ServerConnection, serve

from agents.runtime import connection
from tests.support.loop import run_async

Handler = Callable[[ServerConnection], Awaitable[None]]


def _session(
    server: Handler, wire_format: str, on_frame: Callable[[dict[str, Any]], None]
) -> connection.SessionEnd:
    """One session of the agent's against ``server``; ``on_frame`` sees its frames.  The
    agent says hello first, as the real one does (the server waits for it: what it sends
    before the session takes frames goes websockets' way, in order)."""

    async def on_open(session: connection.Session) -> None:
        await session.send({"type": "hello"})

    async def scenario() -> connection.SessionEnd:
        async with serve(server, "127.0.0.1", 0) as listening:
            port = listening.sockets[0].getsockname()[1]
            return await connection.run_session(
                f"ws://127.0.0.1:{port}/", "key", wire_format, on_open, on_frame, lambda: None
            )

    return run_async(scenario())


def _msgpack(frame: dict[str, Any]) -> bytes:
    return msgpack.packb(frame, use_bin_type=True)


async def _after_hello(ws: ServerConnection) -> None:
    await ws.recv()
    await asyncio.sleep(0.05)  # the session has set its handler


def test_a_whole_message_is_handled_as_it_is_read_not_in_a_later_task_step() -> None:
    """The handler runs in the socket's data_received (no current task), in order, a
    batch's frames one by one."""
    seen: list[tuple[str, bool]] = []

    async def server(ws: ServerConnection) -> None:
        await _after_hello(ws)
        await ws.send(_msgpack({"type": "work", "n": 1}))
        await ws.send(
            _msgpack({"type": "batch", "frames": [{"type": "work"}, {"type": "result_ack"}]})
        )
        await ws.close(1000, "done")

    def on_frame(frame: dict[str, Any]) -> None:
        seen.append((frame["type"], asyncio.current_task() is None))

    end = _session(server, "msgpack", on_frame)
    assert seen == [("work", True), ("work", True), ("result_ack", True)]
    assert end.detail == "closed by the server (1000: done)"


def test_a_fragmented_message_keeps_its_place_before_whole_ones() -> None:
    """A message in fragments goes through websockets' assembler and the session task;
    the whole messages behind it wait their turn there too, then the fast path resumes."""
    seen: list[tuple[int, bool]] = []

    async def server(ws: ServerConnection) -> None:
        await _after_hello(ws)
        await ws.send(['{"type":"work",', '"n":1}'])  # one text message in two frames
        await ws.send('{"type":"work","n":2}')
        await ws.send('{"type":"work","n":3}')
        await asyncio.sleep(0.1)  # the session task has taken all three meanwhile
        await ws.send('{"type":"work","n":4}')
        await ws.close(1000, "done")

    def on_frame(frame: dict[str, Any]) -> None:
        seen.append((frame["n"], asyncio.current_task() is None))

    _session(server, "json", on_frame)
    assert [n for n, _ in seen] == [1, 2, 3, 4]
    assert seen[0] == (1, False)  # assembled, then handled by the session task
    assert seen[-1] == (4, True)  # nothing queued: as it is read


def test_frames_the_wire_format_refuses_are_ignored_and_bad_utf8_fails_the_socket() -> None:
    """A frame that does not decode, or has no string type, is ignored (logged) and the
    next one is handled; text that is not UTF-8 closes the socket with 1007, as
    websockets' own path always did."""
    seen: list[int] = []
    closed: list[int | None] = []

    async def server(ws: ServerConnection) -> None:
        await _after_hello(ws)
        await ws.send("not json")
        await ws.send('{"type":7}')
        await ws.send('{"type":"work","n":1}')
        await asyncio.sleep(0.05)
        ws.protocol.send_text(b"\xff\xfe")
        ws.send_data()
        await ws.wait_closed()
        closed.append(ws.close_code)

    def on_frame(frame: dict[str, Any]) -> None:
        seen.append(frame["n"])

    end = _session(server, "json", on_frame)
    assert seen == [1]
    assert closed == [1007]
    assert end.action is connection.Action.RECONNECT


def test_what_the_handler_raises_ends_the_session_and_is_raised_by_it() -> None:
    class Broken(Exception):
        pass

    async def server(ws: ServerConnection) -> None:
        await _after_hello(ws)
        await ws.send(_msgpack({"type": "work"}))
        await ws.wait_closed()

    def on_frame(frame: dict[str, Any]) -> None:
        raise Broken("the handler broke")

    with pytest.raises(Broken):
        _session(server, "msgpack", on_frame)
