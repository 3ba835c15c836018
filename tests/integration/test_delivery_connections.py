"""The delivery loops' own connections (fleet/executors/fleet/delivery/pg.py) send list
parameters as binary arrays, and every list-taking statement they run accepts them: a
binary array is typed by its elements (a list of ``str`` is ``text[]``, a list of small
``int`` is ``int2[]``), where a text array took the type the statement gave it."""

from __future__ import annotations

import pytest
from psycopg.adapt import PyFormat
from psycopg.types.array import ListBinaryDumper

from fleet.executors.fleet.delivery import relay
from fleet.executors.fleet.delivery.batch_placement import place_tasks
from fleet.executors.fleet.delivery.pg import connect_async
from fleet.executors.fleet.delivery.placement import Delivered
from fleet.executors.fleet.state import ledger
from fleet.models import DeliveryOutbox
from fleet.platform.tenancy import ApiKey
from tests.integration.test_fleet_one_trip import one_task
from tests.support.agents import make_agent
from tests.support.loop import run_async

pytestmark = pytest.mark.django_db(transaction=True)


def on_delivery_connection(scenario):
    """Run ``scenario(conn)`` on a fresh connect_async connection, closed afterwards."""

    async def run():
        conn = await connect_async("test-delivery-connections")
        try:
            return await scenario(conn)
        finally:
            await conn.close()

    return run_async(run())


def test_the_delivery_connections_dump_lists_as_binary_arrays():
    async def dumper(conn):
        return conn.adapters.get_dumper(list, PyFormat.AUTO)

    assert on_delivery_connection(dumper) is ListBinaryDumper


def test_their_list_statements_take_binary_arrays(tenant):
    agent = make_agent(tenant, "a", max_concurrency=4)
    first, second = one_task(tenant), one_task(tenant, package=False)
    placed = place_tasks([first.pk, second.pk], "server-1")
    assert all(isinstance(p, Delivered) for p in placed.values())
    confirmed, untaken = placed[first.pk].outbox_id, placed[second.pk].outbox_id
    key = ApiKey.objects.filter(tenant=tenant).first()
    key_ids = [key.pk] if key is not None else []

    async def scenario(conn):
        # The agents as strings: the cast makes them uuid (a binary text[] would not
        # compare with the uuid column).
        cursor = await conn.execute(
            ledger.RECEIVED_MANY, {"agents": [str(agent.id)], "ids": [confirmed]}
        )
        marked = [row[0] for row in await cursor.fetchall()]
        await conn.execute(ledger.UNTAKE, [[untaken]])
        await conn.execute(ledger.UNTAKE, [[]])  # an empty list has no element type
        cursor = await conn.execute(relay._ACTIVE_KEYS, [key_ids + [2**40]])
        active = [row[0] for row in await cursor.fetchall()]
        cursor = await conn.execute(relay._ACTIVE_KEYS, [[]])
        return marked, active, await cursor.fetchall()

    marked, active, none = on_delivery_connection(scenario)
    assert marked == [confirmed]
    assert DeliveryOutbox.objects.get(pk=confirmed).received_at is not None
    assert DeliveryOutbox.objects.get(pk=untaken).state == "pending"
    assert active == key_ids and none == []
