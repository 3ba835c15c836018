"""The delivery WebSocket through the real ASGI application (routing + auth + consumer)."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid

import pytest

from agents.models import Agent
from agents.protocol import wire
from agents.surface import consumers
from fleet.executors.fleet.delivery import local_sockets, redelivery
from fleet.executors.fleet.delivery.placement import place_task
from fleet.executors.fleet.delivery.relay import Relay
from fleet.executors.fleet.lifecycle import revoke_key
from fleet.models import ApiKey, DeliveryOutbox, TaskAttemptLog, TaskExecution
from tests.support.agents import make_agent
from tests.support.factories import ready_root, two_task_package
from tests.support.loop import run_async
from tests.support.sockets import (
    close_code,
    forget_sockets,  # noqa: F401 (an autouse fixture)
    opened,
    socket,
)
from tests.support.waiting import until

pytestmark = pytest.mark.django_db(transaction=True)


def test_bad_missing_and_revoked_keys_are_closed_4401(tenant):
    agent = make_agent(tenant, connected=False)
    revoked, token = ApiKey.mint("agent", tenant=tenant)
    revoke_key(revoked)

    async def scenario():
        codes = []
        for key in ("clk_abc_def", None, token):
            comm = socket(agent.id, key)
            await comm.connect()
            codes.append(await close_code(comm))
            await comm.disconnect()
        return codes

    assert run_async(scenario()) == [4401, 4401, 4401]
    agent.refresh_from_db()
    assert (agent.connected_to, agent.connection_generation) == ("", 0)


def test_a_non_agent_key_is_closed_4403(tenant, read_key):
    agent = make_agent(tenant, connected=False)

    async def scenario():
        comm = socket(agent.id, read_key)
        await comm.connect()
        code = await close_code(comm)
        await comm.disconnect()
        return code

    assert run_async(scenario()) == 4403


def test_another_tenants_or_a_dead_agent_is_closed_4404(tenant, other_tenant, agent_key):
    foreign = make_agent(other_tenant, connected=False)
    dead = make_agent(tenant, state="dead", connected=False)

    async def scenario():
        codes = []
        for agent_id in (foreign.id, dead.id, uuid.uuid4(), "not-a-uuid"):
            comm = socket(agent_id, agent_key)
            await comm.connect()
            codes.append(await close_code(comm))
            await comm.disconnect()
        return codes

    assert run_async(scenario()) == [4404, 4404, 4404, 4404]
    foreign.refresh_from_db()
    assert foreign.connected_to == "" and foreign.connection_generation == 0


def test_a_connection_owns_the_agent_and_beats_and_confirms_over_the_socket(tenant, agent_key):
    two_task_package(tenant)
    agent = make_agent(tenant, connected=False)
    make_agent(tenant, "helper")  # takes the packet below while `agent` is not connected
    _, task = ready_root(tenant)
    place_task(task.pk, "s")
    row = DeliveryOutbox.objects.get(task_execution=task)
    DeliveryOutbox.objects.filter(pk=row.pk).update(agent=agent, state="delivered")
    Agent.objects.filter(pk=agent.pk).update(last_heartbeat="2001-01-01T00:00:00Z")

    async def scenario():
        comm = socket(agent.id, agent_key)
        await opened(comm, hello=[[str(task.pk), row.assignment]])
        await until(lambda: local_sockets.get(agent.id) is not None)
        await comm.send_json_to({"type": "heartbeat", "in_flight": 1, "metrics": {"load": 0.5}})
        await comm.send_json_to({"type": "received", "outbox_id": row.id})
        await until(lambda: Agent.objects.get(pk=agent.pk).metrics == {"load": 0.5})
        await comm.disconnect()

    run_async(scenario())
    agent.refresh_from_db()
    assert agent.connection_generation == 1 and agent.last_heartbeat.year > 2001
    assert agent.connected_to == ""  # the disconnect released it
    row.refresh_from_db()
    assert row.state == "delivered" and row.received_at is not None
    assert local_sockets.get(agent.id) is None


# Any execution id: the frames are refused for the assignment number next to it.  Fixed, not
# uuid4(), so every pytest-xdist worker collects the same test ids.
HELD_EXECUTION = "5a0f1c52-7d3e-4e0b-9c1a-2b6f0d4e8a17"


@pytest.mark.parametrize(
    ("frame", "why"),
    [
        ("not json", "text"),
        ("[1, 2]", "array"),
        ('{"type": "gossip"}', "unknown type"),
        ('{"type": "received", "outbox_id": "seven"}', "bad field"),
        ('{"type": "hello", "holding": [["x", 1]]}', "bad holding"),
        ('{"type": "heartbeat", "x": NaN}', "NaN"),
        # Past delivery_outbox.id (bigint) / the int4 assignment column: refused at the frame,
        # never handed to the writer's batched UPDATE.
        (f'{{"type": "received", "outbox_id": {2**64 - 1}}}', "outbox_id past bigint"),
        (f'{{"type": "received", "outbox_id": {2**63}}}', "outbox_id just past bigint"),
        ('{"type": "received", "outbox_id": 0}', "outbox_id zero"),
        ('{"type": "received", "outbox_id": -5}', "outbox_id negative"),
        (f'{{"type": "hello", "holding": [["{HELD_EXECUTION}", {2**31}]]}}', "assignment past int"),
        (f'{{"type": "hello", "holding": [["{HELD_EXECUTION}", "3"]]}}', "assignment a string"),
        (f'{{"type": "hello", "holding": [["{HELD_EXECUTION}", 1.5]]}}', "assignment a float"),
        (f'{{"type": "hello", "holding": [["{HELD_EXECUTION}", true]]}}', "assignment a bool"),
        (
            '{"type": "log", "task_execution_id": "x", "assignment": 1, "text": "", "bytes": 0}',
            "log: task id not a uuid",
        ),
        (
            f'{{"type": "log", "task_execution_id": "{HELD_EXECUTION}", "assignment": 0, '
            '"text": "", "bytes": 0}',
            "log: assignment zero",
        ),
        (
            f'{{"type": "log", "task_execution_id": "{HELD_EXECUTION}", "assignment": 1, '
            '"text": 5, "bytes": 0}',
            "log: text not a string",
        ),
        (
            f'{{"type": "log", "task_execution_id": "{HELD_EXECUTION}", "assignment": 1, '
            '"text": "x", "bytes": -1}',
            "log: bytes negative",
        ),
    ],
)
def test_a_malformed_frame_is_closed_4400(tenant, agent_key, frame, why):
    agent = make_agent(tenant, connected=False)

    async def scenario():
        comm = socket(agent.id, agent_key)
        await comm.connect()
        await comm.send_to(text_data=frame)
        code = await close_code(comm)
        await comm.disconnect()
        return code

    assert run_async(scenario()) == 4400, why


def test_an_oversized_frame_is_closed_4413(tenant, agent_key):
    agent = make_agent(tenant, connected=False)

    async def scenario():
        comm = socket(agent.id, agent_key)
        await comm.connect()
        big = json.dumps({"type": "heartbeat", "metrics": {"pad": "x" * (1024 * 1024)}})
        await comm.send_to(text_data=big)
        code = await close_code(comm)
        await comm.disconnect()
        return code

    assert run_async(scenario()) == 4413


def test_a_flood_of_frames_is_closed_4429(tenant, agent_key, monkeypatch):
    # The real limits (4,000 frames/s, bursts of 8,000) are sized for busy agents; the
    # test harness cannot send that fast, so it checks the same bucket at a smaller size.
    monkeypatch.setattr(consumers, "FRAME_RATE_PER_S", 50.0)
    monkeypatch.setattr(consumers, "FRAME_BURST", 100)
    agent = make_agent(tenant, connected=False)

    async def scenario():
        comm = socket(agent.id, agent_key)
        await opened(comm)
        for _ in range(1000):
            await comm.send_json_to({"type": "received", "outbox_id": 1})
        code = await close_code(comm, timeout=10)
        await comm.disconnect()
        return code

    assert run_async(scenario()) == 4429

    # …and the server keeps serving: the agent can connect again.
    async def again():
        comm = socket(agent.id, agent_key)
        await opened(comm)
        await until(lambda: local_sockets.get(agent.id) is not None)
        await comm.disconnect()

    run_async(again())


def test_the_relay_pushes_pending_work_to_the_socket(tenant, agent_key):
    two_task_package(tenant)
    agent = make_agent(tenant, connected=False)
    _, task = ready_root(tenant, {"n": 1})
    Agent.objects.filter(pk=agent.pk).update(connected_to=local_sockets.server_id())
    place_task(task.pk, "s")
    row = DeliveryOutbox.objects.get(task_execution=task)

    async def scenario():
        relay = Relay(poll_s=0.05)
        relay.start()
        try:
            comm = socket(agent.id, agent_key)
            await opened(comm)
            frame = await comm.receive_json_from(timeout=5)
            await comm.send_json_to({"type": "received", "outbox_id": frame["packet"]["outbox_id"]})
            await until(lambda: DeliveryOutbox.objects.get(pk=row.pk).received_at is not None)
            await comm.disconnect()
            return frame
        finally:
            await relay.stop()

    frame = run_async(scenario())
    assert frame["type"] == "work"
    assert frame["packet"] == {**row.payload, "outbox_id": row.id}
    row.refresh_from_db()
    assert (row.state, row.attempts) == ("delivered", 1)
    task.refresh_from_db()
    assert task.result_deadline is not None  # the result-wait clock started at delivery


def test_a_newer_connection_supersedes_the_older_one(tenant, agent_key):
    agent = make_agent(tenant, connected=False)

    async def scenario():
        first = socket(agent.id, agent_key)
        await opened(first)
        await until(lambda: local_sockets.get(agent.id) is not None)
        old_channel = local_sockets.get(agent.id).channel_name
        second = socket(agent.id, agent_key)
        await opened(second)
        code = await close_code(first)
        await until(lambda: local_sockets.get(agent.id).channel_name != old_channel)
        await first.disconnect()  # the stale socket's disconnect must not release the agent
        connected_to = await _connected_to(agent.id)
        await second.disconnect()
        return code, connected_to

    code, connected_to = run_async(scenario())
    assert code == 4408
    assert connected_to == local_sockets.server_id()
    agent.refresh_from_db()
    assert (agent.connection_generation, agent.connected_to) == (2, "")


async def _connected_to(agent_id):
    from asgiref.sync import sync_to_async

    return await sync_to_async(lambda: Agent.objects.get(pk=agent_id).connected_to)()


def test_the_relay_closes_the_socket_of_a_dead_agent_4404(tenant, agent_key):
    agent = make_agent(tenant, connected=False)

    async def scenario():
        relay = Relay(poll_s=0.05)
        comm = socket(agent.id, agent_key)
        await opened(comm)
        await until(lambda: local_sockets.get(agent.id) is not None)
        await until(lambda: Agent.objects.filter(pk=agent.pk).update(state="dead") == 1)
        await relay.reconcile()
        code = await close_code(comm)
        await comm.disconnect()
        await relay.stop()
        return code

    assert run_async(scenario()) == 4404


def test_the_relay_closes_only_the_sockets_the_roster_no_longer_backs(tenant, agent_key):
    """The roster check is made in the database (it returns the sockets to close, not a
    row per socket): a socket whose agent is now connected to another server is closed
    4408, one whose agent row is gone 4404, and a healthy one is left alone."""
    healthy, moved, gone = (make_agent(tenant, connected=False) for _ in range(3))

    async def scenario():
        relay = Relay(poll_s=60)
        comms = {}
        for agent in (healthy, moved, gone):
            comms[agent.id] = socket(agent.id, agent_key)
            await opened(comms[agent.id])
            await until(lambda a=agent: local_sockets.get(a.id) is not None)
        await until(
            lambda: Agent.objects.filter(pk=moved.pk).update(connected_to="another-server") == 1
        )
        gone_socket = local_sockets.get(gone.id)
        await until(lambda: Agent.objects.filter(pk=gone.pk).delete()[0] >= 1)
        closed = await relay.reconcile()
        codes = {
            "moved": await close_code(comms[moved.id]),
            "gone": await close_code(comms[gone.id]),
        }
        still_open = local_sockets.get(healthy.id) is not None
        for comm in comms.values():
            await comm.disconnect()
        await relay.stop()
        return closed, codes, still_open, gone_socket is not None

    closed, codes, still_open, gone_was_open = run_async(scenario())
    assert gone_was_open
    assert closed == 2
    assert codes == {"moved": 4408, "gone": 4404}
    assert still_open


def test_a_dead_agents_heartbeat_over_the_socket_closes_it_4404(tenant, agent_key):
    agent = make_agent(tenant, connected=False)

    async def scenario():
        comm = socket(agent.id, agent_key)
        await opened(comm)
        await until(lambda: local_sockets.get(agent.id) is not None)
        await until(lambda: Agent.objects.filter(pk=agent.pk).update(state="dead") == 1)
        await comm.send_json_to({"type": "heartbeat", "in_flight": 0})
        code = await close_code(comm)
        await comm.disconnect()
        return code

    assert run_async(scenario()) == 4404
    assert TaskExecution.objects.count() == 0


def delivered_packet(tenant):
    """A root task placed on an agent whose socket is this server's, its packet delivered;
    and another agent of the tenant it was never addressed to."""
    two_task_package(tenant)
    agent = make_agent(tenant, connected=False)
    Agent.objects.filter(pk=agent.pk).update(connected_to=local_sockets.server_id())
    _, task = ready_root(tenant)
    place_task(task.pk, "s")
    row = DeliveryOutbox.objects.get(task_execution=task)
    DeliveryOutbox.objects.filter(pk=row.pk).update(state="delivered")
    other = make_agent(tenant, "other")
    return agent, task, row, other


def test_results_over_the_socket_are_applied_and_acknowledged(tenant, agent_key):
    agent, task, row, other = delivered_packet(tenant)
    body = {
        "outbox_id": row.id,
        "task_execution_id": str(task.pk),
        "assignment": row.assignment,
        "outcome": "success",
        "output": {"a": 1},
    }

    async def scenario():
        answers = []
        comm = socket(agent.id, agent_key)
        await opened(comm)
        for frame in (
            {"type": "result", **body, "outcome": "great"},  # invalid: answered, not closed
            {"type": "result", **body},
            {"type": "result", **body},  # a retried report: recorded, not applied
        ):
            await comm.send_json_to(frame)
            answers.append(await comm.receive_json_from(timeout=5))
        await comm.disconnect()
        stranger = socket(other.id, agent_key)  # the packet was never addressed to it
        await opened(stranger)
        await stranger.send_json_to({"type": "result", **body})
        answers.append(await stranger.receive_json_from(timeout=5))
        await stranger.disconnect()
        return answers

    invalid, first, again, foreign = run_async(scenario())
    assert (invalid["type"], invalid["outbox_id"], invalid["status"]) == ("result_ack", row.id, 422)
    assert "outcome" in invalid["detail"]
    assert first == {
        "type": "result_ack",
        "outbox_id": row.id,
        "status": 200,
        "applied": True,
        "reason": "",
    }
    assert (again["status"], again["applied"]) == (200, False)
    assert foreign["status"] == 404 and "never addressed to this agent" in foreign["detail"]
    task.refresh_from_db()
    assert (task.status, task.output_context) == ("Completed", {"a": 1})


def test_log_frames_tail_the_running_task_and_its_result_carries_the_whole_log(tenant, agent_key):
    agent, task, row, other = delivered_packet(tenant)

    def log(text: str, end: int) -> dict:
        return {"type": "log", "task_execution_id": str(task.pk),
                "assignment": row.assignment, "text": text, "bytes": end, "skipped": 0}  # fmt: skip

    def stored() -> str | None:
        entry = TaskAttemptLog.objects.filter(task_execution=task).first()
        return entry and entry.text

    async def scenario():
        stranger = socket(other.id, agent_key)  # not the agent holding the task: ignored
        await opened(stranger)
        await stranger.send_json_to(log("not mine\n", 9))
        await stranger.send_json_to({"type": "heartbeat", "in_flight": 0})
        await stranger.disconnect()
        comm = socket(agent.id, agent_key)
        await opened(comm)
        await comm.send_json_to(log("one\n", 4))
        await comm.send_json_to(log("two\n", 8))
        await until(lambda: stored() == "one\ntwo\n", timeout=10)
        await comm.send_json_to(
            {"type": "result", "outbox_id": row.id, "task_execution_id": str(task.pk),
             "assignment": row.assignment, "outcome": "success", "output": {},
             "log": {"text": "one\ntwo\nthree\n", "bytes": 14, "truncated_bytes": 0}}
        )  # fmt: skip
        ack = await comm.receive_json_from(timeout=5)
        await comm.disconnect()
        return ack

    assert run_async(scenario())["applied"] is True
    entry = TaskAttemptLog.objects.get(task_execution=task)
    assert (entry.text, entry.bytes, entry.finished) == ("one\ntwo\nthree\n", 14, True)


def test_a_result_frame_without_an_outbox_id_is_closed_4400(tenant, agent_key):
    agent = make_agent(tenant, connected=False)

    async def scenario():
        comm = socket(agent.id, agent_key)
        await opened(comm)
        await comm.send_json_to({"type": "result", "outcome": "success"})
        code = await close_code(comm)
        await comm.disconnect()
        return code

    assert run_async(scenario()) == 4400


def test_a_pending_row_for_a_socket_here_wakes_the_relay_without_notify_or_poll(tenant, agent_key):
    two_task_package(tenant)
    agent = make_agent(tenant, connected=False)
    _, task = ready_root(tenant, {"n": 1})

    async def scenario():
        from asgiref.sync import sync_to_async

        # No listener (no NOTIFY reaches it) and a poll far beyond the test's waits: only
        # the direct wake can deliver the row.
        relay = Relay(poll_s=600)
        comm = socket(agent.id, agent_key)
        await opened(comm)
        await until(lambda: local_sockets.get(agent.id) is not None)
        relay.start()
        try:
            await until(lambda: relay.rounds >= 1 and not relay.wake.is_set())
            placed = await sync_to_async(place_task)(task.pk, "s")  # committed as pending
            assert (
                await sync_to_async(lambda: DeliveryOutbox.objects.get(task_execution=task).state)()
                == "pending"
            )
            assert relay.wake_for(placed.agent_id) is True
            frame = await comm.receive_json_from(timeout=5)
        finally:
            await comm.disconnect()
            await relay.stop()
        return frame

    frame = run_async(scenario())
    row = DeliveryOutbox.objects.get(task_execution=task)
    assert frame == {"type": "work", "packet": {**row.payload, "outbox_id": row.id}}
    assert (row.state, row.attempts) == ("delivered", 1)
    task.refresh_from_db()
    assert task.result_deadline is not None


def test_wake_for_an_agent_whose_socket_is_elsewhere_does_nothing(tenant):
    relay = Relay(poll_s=600)
    assert relay.wake_for(uuid.uuid4()) is False
    assert not relay.wake.is_set()


def test_a_packet_placed_for_a_socket_here_is_pushed_at_once_without_the_relay(tenant, agent_key):
    from fleet.executors.fleet.delivery.batch_placement import place_tasks
    from fleet.executors.fleet.delivery.placement import Delivered

    two_task_package(tenant)
    agent = make_agent(tenant, connected=False)
    _, task = ready_root(tenant, {"n": 1})

    async def scenario():
        from asgiref.sync import sync_to_async

        relay = Relay(poll_s=60)  # never started: no relay round on its own
        comm = socket(agent.id, agent_key)
        await opened(comm)
        await until(lambda: local_sockets.get(agent.id) is not None)
        placed = (await sync_to_async(place_tasks)([task.pk], "s"))[task.pk]
        assert isinstance(placed, Delivered)
        pushed = await relay.push_delivered(
            placed.agent_id, placed.outbox_id, placed.packet, placed.waited_s
        )
        frame = await comm.receive_json_from(timeout=5)
        await comm.disconnect()
        await relay.stop()
        return pushed, frame

    pushed, frame = run_async(scenario())
    row = DeliveryOutbox.objects.get(task_execution=task)
    assert pushed and frame == {"type": "work", "packet": {**row.payload, "outbox_id": row.id}}
    assert (row.state, row.attempts) == ("delivered", 1)


def test_a_msgpack_agent_gets_binary_frames_and_confirms_in_msgpack(tenant, agent_key):
    from fleet.executors.fleet.delivery.batch_placement import place_tasks
    from fleet.executors.fleet.delivery.placement import Delivered

    two_task_package(tenant)
    agent = make_agent(tenant, connected=False, wire_format="msgpack")
    _, task = ready_root(tenant, {"n": 1})

    async def scenario():
        from asgiref.sync import sync_to_async

        relay = Relay(poll_s=600)
        comm = socket(agent.id, agent_key)
        connected, _ = await comm.connect()
        assert connected
        await comm.send_to(bytes_data=wire.encode({"type": "hello", "holding": []}, "msgpack"))
        await until(lambda: local_sockets.get(agent.id) is not None)
        placed = (await sync_to_async(place_tasks)([task.pk], "s"))[task.pk]
        assert isinstance(placed, Delivered)
        await relay.push_delivered(placed.agent_id, placed.outbox_id, placed.packet, 0.0)
        data = await comm.receive_from(timeout=5)
        frame = wire.decode(data, "msgpack")  # a str (a JSON text frame) would be refused
        confirm = {"type": "received", "outbox_id": frame["packet"]["outbox_id"]}
        await comm.send_to(bytes_data=wire.encode(confirm, "msgpack"))
        await until(lambda: DeliveryOutbox.objects.get(task_execution=task).received_at is not None)
        await comm.disconnect()
        await relay.stop()
        return data, frame

    data, frame = run_async(scenario())
    row = DeliveryOutbox.objects.get(task_execution=task)
    assert isinstance(data, bytes)
    assert frame == {"type": "work", "packet": {**row.payload, "outbox_id": row.id}}


def test_a_delivered_packet_that_cannot_be_pushed_goes_back_to_pending(tenant):
    from fleet.executors.fleet.delivery.batch_placement import place_tasks
    from fleet.executors.fleet.delivery.placement import Delivered

    two_task_package(tenant)
    make_agent(tenant)  # connected here per the roster, but no socket in this process
    _, task = ready_root(tenant)
    placed = place_tasks([task.pk], "s")[task.pk]
    assert isinstance(placed, Delivered)

    async def scenario():
        relay = Relay(poll_s=60)
        try:
            return await relay.push_delivered(
                placed.agent_id, placed.outbox_id, placed.packet, placed.waited_s
            )
        finally:
            await relay.stop()

    assert run_async(scenario()) is False
    row = DeliveryOutbox.objects.get(task_execution=task)
    assert (row.state, row.delivered_at) == ("pending", None)  # a relay pushes it from here


def test_a_confirmation_never_waits_for_a_locked_packet_and_lands_once_it_is_free(
    tenant, agent_key
):
    import threading

    from django.db import connection, transaction

    two_task_package(tenant)
    agent = make_agent(tenant, max_concurrency=4)
    rows = []
    for _ in range(2):
        _, task = ready_root(tenant)
        place_task(task.pk, "s")
        rows.append(DeliveryOutbox.objects.get(task_execution=task))
    locked, release = threading.Event(), threading.Event()

    def hold_lock() -> None:  # e.g. a result batch acking that packet right now
        try:
            with transaction.atomic():
                DeliveryOutbox.objects.select_for_update().get(pk=rows[0].pk)
                locked.set()
                release.wait(10)
        finally:
            connection.close()

    holder = threading.Thread(target=hold_lock)

    async def scenario():
        comm = socket(agent.id, agent_key)
        await opened(comm)
        await until(lambda: local_sockets.get(agent.id) is not None)  # hello handled
        await until(lambda: DeliveryOutbox.objects.update(state="delivered") == 2)
        holder.start()
        locked.wait(5)
        for row in rows:
            await comm.send_json_to({"type": "received", "outbox_id": row.id})
        # The free packet is confirmed while the other is still locked.
        await until(lambda: DeliveryOutbox.objects.get(pk=rows[1].pk).received_at is not None)
        await asyncio.sleep(0.1)  # rounds of retries while it stays locked
        assert (await _row(rows[0].pk)).received_at is None
        release.set()
        await until(lambda: DeliveryOutbox.objects.get(pk=rows[0].pk).received_at is not None)
        await comm.disconnect()

    try:
        run_async(scenario())
    finally:
        release.set()
        if holder.is_alive():
            holder.join()


async def _row(pk):
    from asgiref.sync import sync_to_async

    return await sync_to_async(lambda: DeliveryOutbox.objects.get(pk=pk))()


def test_a_write_the_database_refuses_costs_the_other_sockets_nothing(tenant, agent_key):
    """Frames are bounded at the socket, but should a value the database refuses reach the
    writer anyway, the round's other confirmations still land, the writer keeps its
    connection, and only the offender's socket is closed (4400)."""
    from fleet.executors.fleet import socket_writes

    two_task_package(tenant)
    honest = make_agent(tenant, "honest", max_concurrency=8, connected=False)
    rogue = make_agent(tenant, "rogue", connected=False)
    make_agent(tenant, "helper", max_concurrency=8)  # takes the packets; they move to honest
    rows = []
    for _ in range(3):
        _, task = ready_root(tenant)
        place_task(task.pk, "s")
        rows.append(DeliveryOutbox.objects.get(task_execution=task))
    DeliveryOutbox.objects.update(agent=honest)

    async def scenario():
        good, bad = socket(honest.id, agent_key), socket(rogue.id, agent_key)
        await opened(good)
        await opened(bad)
        await until(lambda: local_sockets.get(honest.id) and local_sockets.get(rogue.id))
        await until(lambda: DeliveryOutbox.objects.update(state="delivered") == 3)
        writes = socket_writes.writer()
        await writes.heartbeat(honest.id, tenant.id, [], None, False)  # the connection is open
        conn = writes._conn
        for round_ in range(3):  # every round holds a refused id and an honest confirmation
            writes.received(rogue.id, [2**64 - 1 - round_])
            writes.received(honest.id, [rows[round_].id])
            await asyncio.sleep(0.05)
        code = await close_code(bad)
        await until(lambda: not DeliveryOutbox.objects.filter(received_at__isnull=True).exists())
        # Beats of one round: the one jsonb refuses (NaN, which the frame check would stop)
        # is refused alone; the honest one is written.
        refused, honest_beat = await asyncio.gather(
            writes.heartbeat(rogue.id, tenant.id, [], json.dumps({"x": float("nan")}), False),
            writes.heartbeat(honest.id, tenant.id, [], json.dumps({"load": 0.25}), False),
            return_exceptions=True,
        )
        assert isinstance(refused, socket_writes.WriteRefused), refused
        assert honest_beat is not None and honest_beat.state == "live", honest_beat
        kept = writes._conn is conn
        await good.send_json_to({"type": "heartbeat", "in_flight": 0})
        await good.receive_nothing(0.3)  # still open
        await good.disconnect()
        await bad.disconnect()
        return code, kept

    code, kept = run_async(scenario())
    assert code == 4400
    assert kept, "the writer tore its connection down for one socket's bad write"
    assert DeliveryOutbox.objects.filter(received_at__isnull=False).count() == 3
    assert Agent.objects.get(pk=honest.pk).metrics == {"load": 0.25}


@pytest.mark.parametrize("how", ["key revoked", "tenant deactivated"])
def test_a_socket_is_bound_to_the_key_it_was_opened_with_and_closed_4401_with_it(tenant, how):
    """The agent was registered with another key (revoking this one retires none of its
    agents), yet the socket this key opened must not outlive the key or its tenant."""
    from fleet.models import Tenant

    registering, _ = ApiKey.mint("agent", tenant=tenant)
    agent = make_agent(tenant, connected=False)
    Agent.objects.filter(pk=agent.pk).update(api_key=registering)
    opener, token = ApiKey.mint("agent", tenant=tenant)
    bystander_tenant = Tenant.objects.create(name="bystander")
    bystander = make_agent(bystander_tenant, connected=False)
    _, bystander_token = ApiKey.mint("agent", tenant=bystander_tenant)

    async def scenario():
        from asgiref.sync import sync_to_async

        relay = Relay(poll_s=0.05)
        comm, other = socket(agent.id, token), socket(bystander.id, bystander_token)
        await opened(comm)
        await opened(other)
        await until(lambda: local_sockets.get(agent.id) and local_sockets.get(bystander.id))
        assert await relay.reconcile() == 0  # both keys active: nothing to close
        if how == "key revoked":
            await sync_to_async(revoke_key)(opener)
        else:
            await sync_to_async(Tenant.objects.filter(pk=tenant.pk).update)(is_active=False)
        closed = await relay.reconcile()
        code = await close_code(comm)
        await other.receive_nothing(0.2)  # another tenant's socket stays open
        await comm.disconnect()
        await other.disconnect()
        await relay.stop()
        return closed, code

    closed, code = run_async(scenario())
    assert (closed, code) == (1, 4401), how
    agent.refresh_from_db()
    assert agent.state == "live"  # revocation retires the agents of the key, not this one


def test_a_beat_lands_while_the_sockets_hello_waits_on_a_busy_delivery_pool(
    tenant, agent_key, monkeypatch
):
    """The 2,000-agent evictions: a socket's beats queued behind its hello, and the hello
    behind a storm's registrations on the delivery pool; the agent was evicted with its
    socket open.  A beat is written by the socket writer whatever the pool is doing."""
    agent = make_agent(tenant, connected=False)
    Agent.objects.filter(pk=agent.pk).update(last_heartbeat="2001-01-01T00:00:00Z")
    pool_busy = threading.Event()
    apply_hello = redelivery.apply_hello

    def slow_hello(agent_id, holding):
        pool_busy.wait(30)  # the delivery pool is busy: this hello waits for a thread
        return apply_hello(agent_id, holding)

    monkeypatch.setattr(redelivery, "apply_hello", slow_hello)

    async def scenario() -> bool:
        comm = socket(agent.id, agent_key)
        await opened(comm)  # the hello is sent and waits
        await comm.send_json_to({"type": "heartbeat", "in_flight": 0, "metrics": {"up": 1}})
        await until(lambda: Agent.objects.get(pk=agent.pk).metrics == {"up": 1})
        hello_still_waiting = local_sockets.get(agent.id) is None
        pool_busy.set()
        await until(lambda: local_sockets.get(agent.id) is not None)
        await comm.disconnect()
        return hello_still_waiting

    try:
        assert run_async(scenario()) is True
    finally:
        pool_busy.set()
    agent.refresh_from_db()
    assert agent.last_heartbeat.year > 2001 and agent.state == "live"


def test_a_plain_beat_takes_the_frame_shortcut_and_other_frames_do_not(tenant, agent_key):
    """Under `serve` the consumer installs a frame shortcut (daphne_server.py): a plain
    MessagePack beat is written from there; any other frame is left to the usual way."""
    from agents.protocol import frames

    agent = make_agent(tenant, connected=False, wire_format="msgpack")
    Agent.objects.filter(pk=agent.pk).update(last_heartbeat="2001-01-01T00:00:00Z")
    installed: list = []

    async def scenario():
        comm = socket(agent.id, agent_key)
        comm.scope[consumers.FRAME_SHORTCUT] = installed.append  # as daphne_server offers it
        connected, _ = await comm.connect()
        assert connected
        await comm.send_to(bytes_data=wire.encode({"type": "hello", "holding": []}, "msgpack"))
        await until(lambda: local_sockets.get(agent.id) is not None)
        [take] = installed
        beat = wire.encode(frames.heartbeat(0, [], {"load": 0.5}, False), "msgpack")
        left = [
            take(wire.encode({"type": "received", "outbox_id": 1}, "msgpack"), True),
            take(beat, False),  # a text frame: not what this msgpack socket speaks
            take(wire.encode({"type": "heartbeat", "metrics": {"x": {"y": 1}}}, "msgpack"), True),
        ]
        taken = take(beat, True)
        await until(lambda: Agent.objects.get(pk=agent.pk).metrics == {"load": 0.5})
        await comm.disconnect()
        return taken, left

    taken, left = run_async(scenario())
    assert taken and left == [False, False, False]
    assert Agent.objects.get(pk=agent.pk).last_heartbeat.year > 2001
