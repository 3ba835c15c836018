"""The relay's round asks the database which agents connected to this server have pending
rows (``connected_to``), instead of sending every local socket's id (docs/scaling.md).

It takes only the rows of agents whose socket this process holds past its hello: a row of
an agent the roster puts here whose socket is not registered yet stays pending, its
``attempts`` untouched, and one of an agent the roster puts on another server is that
server's relay's.
"""

from __future__ import annotations

import uuid

import pytest

from agents.models import Agent
from fleet.executors.fleet.delivery import local_sockets
from fleet.executors.fleet.delivery.placement import place_task
from fleet.executors.fleet.delivery.relay import ROSTER_DIGEST, Relay
from fleet.models import DeliveryOutbox
from tests.support.agents import make_agent
from tests.support.factories import ready_root, two_task_package
from tests.support.loop import run_async

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _forget_sockets():
    local_sockets.clear()
    yield
    local_sockets.clear()


def _register(agent_id: uuid.UUID, tenant_id: int, written: list, generation: int = 0) -> None:
    """A socket of this process for ``agent_id``: packets and closes land in ``written``."""

    async def push(packet: dict) -> None:
        written.append(packet)

    async def close(code: int, reason: str) -> None:
        written.append((code, reason))

    local_sockets.register(
        local_sockets.LocalSocket(
            agent_id, tenant_id, f"test.{agent_id}", generation, "json", None, push, close
        )
    )


def _round(relay: Relay) -> int:
    async def scenario() -> int:
        try:
            return await relay.run_once()
        finally:
            await relay.stop()

    return run_async(scenario())


def _quiet_relay() -> Relay:
    relay = Relay(poll_s=600)
    relay._last_reconcile = float("inf")  # rounds only take rows: no roster check here
    return relay


def test_a_row_waits_until_its_socket_here_is_registered_then_is_pushed(tenant):
    two_task_package(tenant)
    agent = make_agent(tenant, connected=True)  # the roster puts its socket on this server
    _, task = ready_root(tenant, {"n": 1})
    place_task(task.pk, "s")
    written: list[dict] = []

    assert _round(_quiet_relay()) == 0  # before its hello: not taken, not counted
    row = DeliveryOutbox.objects.get(task_execution=task)
    assert (row.state, row.attempts) == ("pending", 0)

    _register(agent.id, tenant.pk, written)
    assert _round(_quiet_relay()) == 1
    row.refresh_from_db()
    assert (row.state, row.attempts) == ("delivered", 1)
    assert written == [{**row.payload, "outbox_id": row.id}]


def test_a_row_of_an_agent_connected_to_another_server_is_left_to_that_server(tenant):
    two_task_package(tenant)
    agent = make_agent(tenant, connected="another-server")
    _, task = ready_root(tenant, {"n": 1})
    place_task(task.pk, "s")
    written: list[dict] = []
    _register(agent.id, tenant.pk, written)  # a stale socket here: the roster says elsewhere

    assert _round(_quiet_relay()) == 0
    row = DeliveryOutbox.objects.get(task_execution=task)
    assert (row.state, row.attempts, written) == ("pending", 0, [])


def _roster_digest() -> tuple[int, int]:
    async def scenario() -> tuple[int, int]:
        relay = Relay(poll_s=600)
        try:
            conn = await relay._connection()
            cursor = await conn.execute(ROSTER_DIGEST, {"me": local_sockets.server_id()})
            count, total = await cursor.fetchone()
            return count, int(total)
        finally:
            await relay.stop()

    return run_async(scenario())


def test_the_roster_digest_in_sql_is_the_sockets_digest_here(tenant):
    agents = [make_agent(tenant, connected=True) for _ in range(3)]
    make_agent(tenant, connected="another-server")
    make_agent(tenant, connected=True, state="dead")  # not backed: not in the roster's sum
    closes: list = []
    for agent in agents:
        _register(agent.id, tenant.pk, closes)
    assert local_sockets.digest()[0] == 3
    assert _roster_digest() == local_sockets.digest()
    assert _round_reconcile() == 0 and closes == []

    # A newer connection of one agent (its generation moves on): the digests differ, and
    # the per-socket comparison closes the superseded socket.
    Agent.objects.filter(pk=agents[0].pk).update(connection_generation=1)
    assert _roster_digest() != local_sockets.digest()
    assert _round_reconcile() == 1
    assert closes == [(4408, "superseded by a newer connection")]
    assert local_sockets.get(agents[0].id) is None
    _register(agents[0].id, tenant.pk, closes, generation=1)  # its new socket, here
    assert _roster_digest() == local_sockets.digest()


def _round_reconcile() -> int:
    async def scenario() -> int:
        relay = Relay(poll_s=600)
        try:
            return await relay.reconcile()
        finally:
            await relay.stop()

    return run_async(scenario())
