"""The relay hands a packet to a socket of this process by a direct call (no channel layer).

Here: the unit tests (no database, socket or process); the relay's database rounds are in
tests/integration/test_fleet_consumer.py.
"""

from __future__ import annotations

import asyncio
import uuid

from fleet.executors.fleet.delivery import local_sockets
from fleet.executors.fleet.delivery.relay import SOCKET_WAKE_S, Relay
from tests.support.loop import run_async
from tests.support.socket_registry import forget_sockets  # noqa: F401  (autouse)


def _socket(agent_id: uuid.UUID, push) -> local_sockets.LocalSocket:
    async def close(code: int, reason: str) -> None:
        raise AssertionError(f"closed {code} {reason}")

    return local_sockets.LocalSocket(agent_id, 1, "nowhere!", 1, "msgpack", None, push, close)


def test_a_placed_packet_goes_straight_to_the_consumers_push():
    agent_id = uuid.uuid4()
    written: list[dict] = []

    async def push(packet: dict) -> None:
        written.append(packet)

    local_sockets.register(_socket(agent_id, push))
    packet = {"outbox_id": 7, "task_execution_id": str(uuid.uuid4())}

    async def scenario() -> bool:
        return await Relay(poll_s=600).push_delivered(agent_id, 7, packet, 0.001)

    relay_pushed = run_async(scenario())
    assert relay_pushed is True
    assert written == [packet]  # the same object: no copy on the way


def test_a_push_that_raises_costs_the_relay_nothing():
    agent_id = uuid.uuid4()

    async def push(packet: dict) -> None:
        raise ValueError("cannot encode")

    local_sockets.register(_socket(agent_id, push))

    async def scenario() -> tuple[bool, int]:
        relay = Relay(poll_s=600)
        pushed = await relay.push_delivered(agent_id, 8, {"outbox_id": 8}, 0.0)
        return pushed, relay.pushed

    # Left delivered and unconfirmed: redelivery retries it, then fails it with a reason.
    assert run_async(scenario()) == (True, 1)


def test_sockets_registering_together_wake_the_relay_once_soon_after():
    # A connect storm's hellos each woke a round (a query) of their own.
    async def push(packet: dict) -> None:
        raise AssertionError("nothing to push")

    async def scenario() -> tuple[bool, bool, bool]:
        relay = Relay(poll_s=600)
        local_sockets.on_register(relay.on_socket)
        try:
            for _ in range(100):
                local_sockets.register(_socket(uuid.uuid4(), push))
            woken_at_once = relay.wake.is_set()
            await asyncio.wait_for(relay.wake.wait(), timeout=30)
            relay.wake.clear()
            await asyncio.sleep(SOCKET_WAKE_S * 2)  # no second wake-up queued behind it
            woken_again = relay.wake.is_set()
            local_sockets.register(_socket(uuid.uuid4(), push))  # a later socket: a new one
            await asyncio.wait_for(relay.wake.wait(), timeout=30)
            return woken_at_once, woken_again, relay.wake.is_set()
        finally:
            await relay.stop()

    assert run_async(scenario()) == (False, False, True)
