"""Batched frames on the real delivery socket (docs/agent-protocol.md, "Batched frames"):
an agent's batch of confirmations and outcomes is applied as its frames would be one by one
and answered in one batch of acks; packets pushed in one loop turn travel in one batch; an
agent that did not ask for batches (an older runagent) keeps getting one frame each, and
its batch — should it send one — is taken all the same."""

from __future__ import annotations

import asyncio

import pytest

from agents.models import Agent
from agents.protocol import frames
from fleet.executors.fleet.delivery import local_sockets
from fleet.executors.fleet.delivery.placement import place_task
from fleet.models import DeliveryOutbox, TaskExecution
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


def _two_delivered_packets(tenant):
    """Two root tasks placed on one agent whose socket is this server's, delivered."""
    two_task_package(tenant)
    agent = make_agent(tenant, connected=False, max_concurrency=4)
    Agent.objects.filter(pk=agent.pk).update(connected_to=local_sockets.server_id())
    rows = []
    for _ in range(2):
        _, task = ready_root(tenant)
        place_task(task.pk, "s")
        rows.append(DeliveryOutbox.objects.get(task_execution=task))
    DeliveryOutbox.objects.filter(pk__in=[r.pk for r in rows]).update(state="delivered")
    assert {r.agent_id for r in rows} == {agent.pk}
    return agent, rows


def _result(row, **changes) -> dict:
    return {"type": "result", "outbox_id": row.id, "task_execution_id": str(row.task_execution_id),
            "assignment": row.assignment, "outcome": "success", "output": {"n": row.id},
            **changes}  # fmt: skip


@pytest.mark.parametrize("batch_frames", [True, False], ids=["batching agent", "older agent"])
def test_a_batch_of_confirmations_and_results_is_applied_and_acknowledged(
    tenant, agent_key, batch_frames
):
    agent, (one, two) = _two_delivered_packets(tenant)

    async def scenario() -> list[dict]:
        comm = socket(agent.id, agent_key)
        await opened(comm, batch_frames=batch_frames)
        await until(lambda: local_sockets.get(agent.id) is not None)
        batch = [frames.received(one.id), frames.received(two.id), _result(one),
                 _result(two, outcome="great"), _result(two)]  # fmt: skip
        await comm.send_json_to({"type": "batch", "frames": batch})
        answers = [await comm.receive_json_from(timeout=10)]
        if not batch_frames:  # one result_ack frame per result
            answers += [await comm.receive_json_from(timeout=10) for _ in range(2)]
        assert await comm.receive_nothing(timeout=0.3)
        await comm.disconnect()
        return answers

    answers = run_async(scenario())
    if batch_frames:
        assert [a["type"] for a in answers] == ["batch"]
        answers = answers[0]["frames"]
    assert [(a["type"], a["outbox_id"], a["status"]) for a in answers] == [
        ("result_ack", one.id, 200),
        ("result_ack", two.id, 422),
        ("result_ack", two.id, 200),
    ]
    assert answers[0]["applied"] is True and answers[2]["applied"] is True
    assert "outcome" in answers[1]["detail"]
    for row in (one, two):
        row.refresh_from_db()
        assert row.received_at is not None
        task = TaskExecution.objects.get(pk=row.task_execution_id)
        assert (task.status, task.output_context) == ("Completed", {"n": row.id})


@pytest.mark.parametrize("batch_frames", [True, False], ids=["batching agent", "older agent"])
def test_packets_pushed_in_one_loop_turn_travel_in_one_batch_to_an_agent_that_asked(
    tenant, agent_key, batch_frames
):
    agent = make_agent(tenant, connected=False)
    packets = [{"outbox_id": n, "task_execution_id": f"t{n}"} for n in (1, 2, 3)]

    async def scenario() -> list[dict]:
        comm = socket(agent.id, agent_key)
        await opened(comm, batch_frames=batch_frames)
        await until(lambda: local_sockets.get(agent.id) is not None)
        push = local_sockets.get(agent.id).push
        await asyncio.gather(*(push(p) for p in packets))  # one placement batch's pushes
        received = [await comm.receive_json_from(timeout=5)]
        if not batch_frames:
            received += [await comm.receive_json_from(timeout=5) for _ in range(2)]
        assert await comm.receive_nothing(timeout=0.2)
        await push({"outbox_id": 4})  # alone in its turn: a plain work frame
        received.append(await comm.receive_json_from(timeout=5))
        await comm.disconnect()
        return received

    received = run_async(scenario())
    work = [{"type": "work", "packet": p} for p in packets]
    if batch_frames:
        assert received[0] == {"type": "batch", "frames": work}
    else:
        assert received[:3] == work
    assert received[-1] == {"type": "work", "packet": {"outbox_id": 4}}


def test_an_older_and_a_batching_agent_side_by_side_each_get_what_they_asked_for(tenant, agent_key):
    old, new = (
        make_agent(tenant, "old", connected=False),
        make_agent(tenant, "new", connected=False),
    )
    packets = [{"outbox_id": n} for n in (1, 2)]

    async def scenario() -> tuple[list, list]:
        old_comm, new_comm = socket(old.id, agent_key), socket(new.id, agent_key)
        await opened(old_comm, batch_frames=False)
        await opened(new_comm, batch_frames=True)
        await until(lambda: None not in (local_sockets.get(old.id), local_sockets.get(new.id)))
        pushes = [local_sockets.get(a.id).push(p) for a in (old, new) for p in packets]
        await asyncio.gather(*pushes)  # one turn's packets for both sockets
        got_old = [await old_comm.receive_json_from(timeout=5) for _ in packets]
        got_new = [await new_comm.receive_json_from(timeout=5)]
        assert await old_comm.receive_nothing(timeout=0.2)
        assert await new_comm.receive_nothing(timeout=0.2)
        await old_comm.disconnect()
        await new_comm.disconnect()
        return got_old, got_new

    got_old, got_new = run_async(scenario())
    work = [{"type": "work", "packet": p} for p in packets]
    assert got_old == work
    assert got_new == [{"type": "batch", "frames": work}]


@pytest.mark.parametrize(
    "inner",
    [
        [],
        [frames.received(1)] * (frames.MAX_BATCH_FRAMES + 1),
        [frames.received(1), {"type": "heartbeat", "in_flight": 0}],
        [frames.received(1), {"type": "received", "outbox_id": "1"}],
    ],
    ids=["empty", "too many", "a heartbeat", "a bad id"],
)
def test_a_malformed_batch_is_closed_4400_and_changes_nothing(tenant, agent_key, inner):
    agent, (one, _two) = _two_delivered_packets(tenant)

    async def scenario() -> int:
        comm = socket(agent.id, agent_key)
        await opened(comm, batch_frames=True)
        await until(lambda: local_sockets.get(agent.id) is not None)
        await comm.send_json_to({"type": "batch", "frames": inner})
        code = await close_code(comm)
        await comm.disconnect()
        return code

    assert run_async(scenario()) == 4400
    one.refresh_from_db()
    assert one.received_at is None


def test_a_batch_over_the_frame_size_limit_is_closed_4413_before_it_is_parsed(tenant, agent_key):
    agent = make_agent(tenant, connected=False)
    padding = "x" * (1024 * 1024)

    async def scenario() -> int:
        comm = socket(agent.id, agent_key)
        await opened(comm, batch_frames=True)
        await comm.send_json_to({"type": "batch", "frames": [{"type": "received", "p": padding}]})
        code = await close_code(comm)
        await comm.disconnect()
        return code

    assert run_async(scenario()) == 4413
