"""A delivery session pings at the interval the agent gives it (one liveness window:
agents/runtime/connection.ping_interval_s), with a real WebSocket server."""

from __future__ import annotations

import asyncio

from websockets.asyncio.server import serve

from agents.runtime import connection
from tests.support.loop import run_async


def test_a_session_pings_at_the_interval_it_is_given():
    async def scenario() -> tuple[float | None, float | None]:
        async def handler(ws) -> None:
            await asyncio.sleep(30)

        seen: dict[str, float | None] = {}

        async def on_open(session: connection.Session) -> None:
            seen["interval"] = session.ws.ping_interval
            seen["timeout"] = session.ws.ping_timeout
            await session.close()

        async with serve(handler, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            end = await connection.run_session(
                f"ws://127.0.0.1:{port}/", "key", "json", on_open,
                lambda frame: None, lambda: None, ping_every_s=45.0,
            )  # fmt: skip
        assert end.action is connection.Action.CLOSED_BY_US
        return seen["interval"], seen["timeout"]

    assert run_async(scenario()) == (45.0, connection.PING_TIMEOUT_S)
