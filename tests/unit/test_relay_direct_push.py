"""The relay hands a packet to a socket of this process by a direct call (no channel layer).

Here: the unit tests (no database, socket or process); the relay's database rounds are in
tests/integration/test_fleet_consumer.py.
"""

from __future__ import annotations

import uuid

from fleet.executors.fleet.delivery import local_sockets
from fleet.executors.fleet.delivery.relay import Relay
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
