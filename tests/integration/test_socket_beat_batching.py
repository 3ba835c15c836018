"""Heartbeats over the delivery socket are batched: many agents' beats, one statement; and a
beat held back for company never holds back a confirmation (fleet/executors/fleet/socket_writes.py)."""

from __future__ import annotations

import asyncio
import logging
import re

import psycopg
import pytest
from django.db import connection

from agents.models import Agent
from fleet.executors.fleet import socket_writes
from fleet.executors.fleet.delivery import local_sockets
from fleet.executors.fleet.delivery.placement import place_task
from fleet.models import DeliveryOutbox
from fleet.platform.config import apply_overrides
from tests.support.agents import make_agent
from tests.support.factories import ready_root, two_task_package
from tests.support.loop import run_async
from tests.support.sockets import (
    forget_sockets,  # noqa: F401 (an autouse fixture)
    opened,
    socket,
)
from tests.support.waiting import until

pytestmark = pytest.mark.django_db(transaction=True)

LONG_GATHER_S = 30.0  # far longer than any wait below: only a confirmation can end it


def _count_rounds(monkeypatch) -> list[int]:
    """The number of agents in each batched beat statement the writer executes."""
    sizes: list[int] = []
    original = socket_writes.SocketWrites._beat

    async def counting(conn, beats):
        sizes.append(len(beats))
        return await original(conn, beats)

    monkeypatch.setattr(socket_writes.SocketWrites, "_beat", staticmethod(counting))
    return sizes


def delivered_packet(tenant):
    """A packet delivered to an agent (not connected yet) and not confirmed: (agent, task, row)."""
    two_task_package(tenant)
    agent = make_agent(tenant, connected=False)
    make_agent(tenant, "helper")  # placement needs a live agent; the row is then moved
    _, task = ready_root(tenant)
    place_task(task.pk, "s")
    row = DeliveryOutbox.objects.get(task_execution=task)
    DeliveryOutbox.objects.filter(pk=row.pk).update(agent=agent, state="delivered")
    return agent, task, row


def test_it_writes_the_beats_of_many_agents_in_one_statement(tenant, monkeypatch):
    agents = [make_agent(tenant, f"a{i}") for i in range(20)]
    Agent.objects.update(last_heartbeat="2001-01-01T00:00:00Z")
    monkeypatch.setattr(socket_writes, "beat_gather_s", lambda _interval: 0.5)
    sizes = _count_rounds(monkeypatch)

    async def scenario():
        writes = socket_writes.writer()
        beats = []
        for agent in agents:  # arriving one by one, as agents' beats do
            beats.append(
                asyncio.ensure_future(writes.heartbeat(agent.id, tenant.id, [], None, False))
            )
            await asyncio.sleep(0.005)
        answers = await asyncio.gather(*beats)
        await socket_writes.close_writer()
        return answers

    answers = run_async(scenario())
    assert [a.state for a in answers] == ["live"] * 20
    assert sizes == [20]  # one statement for all twenty
    assert not Agent.objects.filter(last_heartbeat__year=2001).exists()


def test_the_gather_window_is_a_small_share_of_the_interval_and_at_most_a_second():
    assert socket_writes.beat_gather_s(1.0) == pytest.approx(0.05)
    assert socket_writes.beat_gather_s(15.0) == pytest.approx(0.75)
    assert socket_writes.beat_gather_s(120.0) == 1.0


def test_a_held_beat_never_holds_back_the_sockets_confirmations(tenant, agent_key, monkeypatch):
    """The beat waits for company (30 s here); the confirmation that follows it on the same
    socket lands at once, and takes the beat along in its round."""
    agent, task, row = delivered_packet(tenant)
    Agent.objects.filter(pk=agent.pk).update(last_heartbeat="2001-01-01T00:00:00Z")
    monkeypatch.setattr(socket_writes, "beat_gather_s", lambda _interval: LONG_GATHER_S)

    async def scenario():
        comm = socket(agent.id, agent_key)
        await opened(comm, hello=[[str(task.pk), row.assignment]])
        await until(lambda: local_sockets.get(agent.id) is not None)
        await comm.send_json_to({"type": "heartbeat", "in_flight": 1, "metrics": {"load": 0.5}})
        await asyncio.sleep(0.2)  # the beat is handled (and held) before the next frame comes
        await comm.send_json_to({"type": "received", "outbox_id": row.id})
        await until(
            lambda: DeliveryOutbox.objects.filter(pk=row.pk, received_at__isnull=False).exists(),
            timeout=5,
        )
        await until(lambda: Agent.objects.get(pk=agent.pk).metrics == {"load": 0.5}, timeout=5)
        await comm.disconnect()

    run_async(scenario())
    agent.refresh_from_db()
    assert agent.last_heartbeat.year > 2001


def test_a_beat_never_waits_for_a_locked_agent_row_nor_holds_up_the_others(tenant):
    """A result batch or a placement may hold an agent's row for a while: the beats of the
    other agents in the round are written at once, the locked agent's once the lock goes
    (not answered "dead" meanwhile, which would close its socket)."""
    locked, free = make_agent(tenant, "locked"), make_agent(tenant, "free")
    Agent.objects.update(last_heartbeat="2001-01-01T00:00:00Z")

    async def scenario():
        holder = await psycopg.AsyncConnection.connect(**_dsn())
        writes = socket_writes.writer()
        try:
            await holder.execute("SELECT 1 FROM agents_agent WHERE id = %s FOR UPDATE", [locked.id])
            held = asyncio.ensure_future(writes.heartbeat(locked.id, tenant.id, [], None, False))
            answered = await asyncio.wait_for(
                writes.heartbeat(free.id, tenant.id, [], None, False), timeout=5
            )
            await asyncio.sleep(0.3)  # several retry rounds while the row stays locked
            waiting = not held.done()
        finally:
            await holder.rollback()
            await holder.close()
        try:
            late = await asyncio.wait_for(held, timeout=5)
        finally:
            await socket_writes.close_writer()
        return answered, waiting, late

    answered, waiting, late = run_async(scenario())
    assert answered is not None and answered.state == "live"
    assert waiting, "the locked agent's beat was answered while its row was locked"
    assert late is not None and late.state == "live"
    assert not Agent.objects.filter(last_heartbeat__year=2001).exists()


def _dsn() -> dict:
    """Connection parameters of the test database, for a second connection that holds a lock."""
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    return {**params, "autocommit": False}


def test_a_round_of_beats_does_not_hold_back_the_next_confirmation(tenant, monkeypatch):
    """Confirmations are spaced out under load (MIN_ROUND_GAP_S, a minute here), but only
    after a round that wrote confirmations: one right after a round of beats goes at once."""
    agent, task, row = delivered_packet(tenant)
    monkeypatch.setattr(socket_writes, "beat_gather_s", lambda _interval: 0.0)
    monkeypatch.setattr(socket_writes, "MIN_ROUND_GAP_S", 60.0)

    async def scenario():
        writes = socket_writes.writer()
        try:
            answer = await writes.heartbeat(agent.id, tenant.id, [], None, False)
            writes.received(agent.id, [row.id])
            await until(
                lambda: DeliveryOutbox.objects.filter(
                    pk=row.pk, received_at__isnull=False
                ).exists(),
                timeout=10,
            )
        finally:
            await socket_writes.close_writer()
        return answer

    assert run_async(scenario()).state == "live"


def test_a_beat_whose_write_failed_is_answered_with_a_newer_one(tenant, monkeypatch):
    """The connection fails while a beat is written, and the agent's next beat arrives
    meanwhile: the retried round answers both (the first one's waiter was dropped, so that
    socket never got an answer again and the agent was evicted while it beat)."""
    agent = make_agent(tenant)
    monkeypatch.setattr(socket_writes, "beat_gather_s", lambda _interval: 0.0)
    original, later = socket_writes.SocketWrites._write, []

    async def fail_once(self, beats, received):
        if not later:
            later.append(self.heartbeat(agent.id, tenant.id, [], '{"load": 2}', False))
            raise psycopg.OperationalError("the connection broke mid-write")
        return await original(self, beats, received)

    monkeypatch.setattr(socket_writes.SocketWrites, "_write", fail_once)

    async def scenario():
        writes = socket_writes.writer()
        try:
            first = await asyncio.wait_for(
                writes.heartbeat(agent.id, tenant.id, [], '{"load": 1}', False), timeout=10
            )
            return [first, await asyncio.wait_for(later[0], timeout=10)]
        finally:
            await socket_writes.close_writer()

    answers = run_async(scenario())
    assert [a.state for a in answers] == ["live", "live"]
    assert Agent.objects.get(pk=agent.pk).metrics == {"load": 2}  # the newer beat's data


def test_a_failing_writer_pauses_at_most_a_quarter_of_the_liveness_window(monkeypatch, caplog):
    """Beats of 0.5 s × 3: a 1.5 s window.  After a database restart the liveness sweep
    gives agents one window for their beats to land again; a writer whose pauses doubled
    up to 2 s was still asleep when it ran out, and every live agent was evicted."""
    apply_overrides(heartbeat_interval_s=0.5, liveness_misses=3)
    failures = 6
    tries: list[int] = []

    async def failing(self, beats, received):
        tries.append(1)
        if len(tries) <= failures:
            raise OSError("the database is away")

    monkeypatch.setattr(socket_writes.SocketWrites, "_write", failing)

    async def scenario():
        socket_writes.writer()._wake.set()
        for _ in range(200):  # 10 s at most; the pauses add up to ~1.8 s
            if len(tries) > failures:
                break
            await asyncio.sleep(0.05)
        await socket_writes.close_writer()

    with caplog.at_level(logging.WARNING, logger=socket_writes.__name__):
        run_async(scenario())
    pauses = [
        float(m.group(1))
        for r in caplog.records
        if (m := re.search(r"retrying in ([0-9.]+)s", r.getMessage()))
    ]
    assert len(tries) == failures + 1  # it kept trying, and the seventh try went through
    # 0.375 s is logged as 0.4; uncapped the pauses went on 0.8, 1.6, 2.0.
    assert pauses == [0.1, 0.2, 0.4, 0.4, 0.4, 0.4]
    assert socket_writes.reconnect_max_s(1.5) == pytest.approx(0.375)
    assert socket_writes.reconnect_max_s(45.0) == socket_writes.RECONNECT_MAX_S
