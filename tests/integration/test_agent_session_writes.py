"""The agent's delivery session writes a loop turn's frames by a callback straight through
websockets' protocol (agents/runtime/connection.py, ``Session.send_soon``): on a real socket
they reach the server whole and in order, and ``ws.send`` is not used for them."""

from __future__ import annotations

import asyncio

import msgpack
from websockets.asyncio.client import connect
from websockets.asyncio.server import serve

from agents.protocol import frames, wire
from agents.runtime.connection import Session
from tests.support.loop import run_async


def _received(outbox_id: int) -> bytes:
    return wire.encode(frames.received(outbox_id), "msgpack")  # type: ignore[return-value]


def test_a_turns_frames_reach_a_real_server_in_order_without_an_awaited_send():
    async def scenario() -> tuple[list[dict], int]:
        got: list[dict] = []
        done = asyncio.Event()

        async def handler(ws) -> None:
            async for message in ws:
                got.append(msgpack.unpackb(message))
                if len(got) == 2:
                    done.set()

        async with serve(handler, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            async with connect(f"ws://127.0.0.1:{port}/") as ws:
                awaited = 0
                send = ws.send

                async def counting_send(*args, **kwargs):
                    nonlocal awaited
                    awaited += 1
                    return await send(*args, **kwargs)

                ws.send = counting_send  # type: ignore[method-assign]
                session = Session(ws, "msgpack", batch_frames=True)
                for outbox_id in (1, 2, 3):
                    assert session.send_soon(_received(outbox_id))
                await asyncio.sleep(0)
                assert session.send_soon(_received(4))  # a later turn: alone
                await asyncio.wait_for(done.wait(), 10)
        return got, awaited

    got, awaited = run_async(scenario())
    assert got == [
        {"type": "batch", "frames": [frames.received(1), frames.received(2), frames.received(3)]},
        frames.received(4),
    ]
    assert awaited == 0  # written by the loop callback, not through ws.send
