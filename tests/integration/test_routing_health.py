"""Health classes (healthy / degraded / unhealthy) and the connection-generation counter,
over real WebSockets through the ASGI application.

Here: the integration tests (database, in-process ASGI, fakes); the rest are in tests/unit/test_routing_health.py.
"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from channels.db import database_sync_to_async as sync_to_async
from django.utils import timezone

from agents.models import Agent
from fleet.executors.fleet.delivery import local_sockets
from fleet.executors.fleet.delivery.placement import NoAgent, Placed, place_task
from tests.support.agents import make_agent
from tests.support.factories import start
from tests.support.loop import run_async
from tests.support.routing import routed_package
from tests.support.sockets import (
    close_code,
    forget_sockets,  # noqa: F401 (an autouse fixture)
    opened,
    socket,
)
from tests.support.waiting import until


@pytest.mark.django_db(transaction=True)
def test_a_stale_disconnect_never_marks_a_reconnected_agent_down(tenant, agent_key):
    routed_package(tenant)
    agent = make_agent(tenant, "w1", connected=False, max_concurrency=8)

    def row():
        return Agent.objects.get(pk=agent.pk)

    def place():
        _, tasks = start(tenant, "demo")
        return place_task(tasks["a"].pk, "test-server")

    async def scenario():
        old = socket(agent.id, agent_key)
        await opened(old)
        await until(lambda: row().connection_generation == 1)
        new = socket(agent.id, agent_key)
        await opened(new)
        # The newer connection supersedes the older one (4408); the older one's
        # disconnect names generation 1 and must not clear generation 2's socket.
        assert await close_code(old) == 4408
        await old.disconnect()
        await until(lambda: row().connection_generation == 2)
        current = await sync_to_async(row)()
        assert current.connected_to == local_sockets.server_id()
        placed = await sync_to_async(place)()
        assert isinstance(placed, Placed) and placed.agent_name == "w1"

        # Degraded: a late heartbeat with the socket open is still selectable.
        await sync_to_async(
            lambda: Agent.objects.filter(pk=agent.pk).update(
                last_heartbeat=timezone.now() - timedelta(seconds=35)
            )
        )()
        assert isinstance(await sync_to_async(place)(), Placed)

        # Unhealthy: the socket is gone; the agent is live but never chosen.
        await new.disconnect()
        await until(lambda: row().connected_to == "")
        waiting = await sync_to_async(place)()
        assert isinstance(waiting, NoAgent)
        return waiting

    waiting = run_async(scenario())
    assert "is connected" in waiting.reason
    assert row().state == "live"  # eviction stays the liveness sweep's call


@pytest.mark.django_db
def test_the_console_roster_shows_degraded_and_unhealthy_agents(tenant):
    from django.contrib.auth import get_user_model
    from django.test import Client

    from fleet.models import TenantMembership

    make_agent(tenant, "fresh")
    make_agent(tenant, "late", heartbeat_age_s=35)
    make_agent(tenant, "cut", connected=False)
    user = get_user_model().objects.create_user("reader", "r@example.com", "x")
    TenantMembership.objects.create(user=user, tenant=tenant, role="read")
    client = Client()
    client.force_login(user)
    page = client.get("/console/tenants/acme/partials/agents/").content.decode()
    rows = {
        m.group(1): m.group(2) for m in re.finditer(r'data-agent="([^"]+)">(.*?)</tr>', page, re.S)
    }
    assert ">degraded</span>" in rows["late"]
    assert ">unhealthy</span>" in rows["cut"]
    assert "degraded" not in rows["fresh"] and "unhealthy" not in rows["fresh"]
