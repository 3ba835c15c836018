"""The agent reports outcomes over its delivery socket when the server answers ``result``
frames, and falls back to REST whenever an answer does not come: a silent server, a
socket that closes first, a server that never announced it.  Nothing is lost either way.

Against the fake of test_agent_runtime_fake_server.py (a real WebSocket server, REST
through httpx.MockTransport); the real server's side is test_fleet_consumer.py and
test_fleet_e2e.py.
"""

from __future__ import annotations

import asyncio

from agents.runtime import outcome_reporter
from tests.support.fakes.agent_server import FakeServer, packet, run_scenario


def _posted_results(fake: FakeServer) -> list[dict]:
    return [body for _method, path, body in fake.calls if path.endswith("/results")]


def test_outcomes_go_over_the_socket_when_the_server_answers_result_frames(tmp_path):
    async def scenario(fake: FakeServer, agent, agent_task) -> None:
        await fake.next_frame("hello")
        await fake.push(packet(1))
        await fake.push(packet(2, sleep_s=0.2))
        frames = [await fake.socket_results.get(), await fake.socket_results.get()]
        assert sorted((f["outbox_id"], f["outcome"]) for f in frames) == [
            (1, "success"),
            (2, "success"),
        ]
        assert frames[0]["assignment"] == 1 and "task_execution_id" in frames[0]
        for _ in range(100):  # settled once the ack is in: nothing held any more
            if not agent.intake.held:
                break
            await asyncio.sleep(0.02)
        assert agent.intake.held == {}
        assert agent.intake.reporter.answered_by_socket == 2
        assert _posted_results(fake) == []  # not one result POST

    run_scenario(tmp_path, scenario, result_frames=True)


def test_a_server_that_does_not_announce_result_frames_gets_rest(tmp_path):
    async def scenario(fake: FakeServer, agent, agent_task) -> None:
        await fake.next_frame("hello")
        await fake.push(packet(1))
        assert (await fake.results.get())["outbox_id"] == 1
        assert fake.socket_results.empty()

    run_scenario(tmp_path, scenario)


def test_no_result_ack_in_time_sends_the_outcome_over_rest(tmp_path, monkeypatch):
    monkeypatch.setattr(outcome_reporter, "RESULT_ACK_TIMEOUT_S", 0.3)

    async def scenario(fake: FakeServer, agent, agent_task) -> None:
        await fake.next_frame("hello")
        await fake.push(packet(1))
        over_socket = await fake.socket_results.get()
        over_rest = await fake.results.get()  # after the ack timeout
        assert over_rest == {k: v for k, v in over_socket.items() if k != "type"}
        assert agent.intake.reporter.answered_by_socket == 0

    run_scenario(tmp_path, scenario, result_frames=True, socket_answers=["silent"])


def test_a_socket_that_closes_before_the_ack_means_report_again(tmp_path):
    async def scenario(fake: FakeServer, agent, agent_task) -> None:
        await fake.next_frame("hello")
        await fake.push(packet(1))
        first = await fake.socket_results.get()  # answered by closing the socket
        # Reported again at once, over REST (no socket) or over the next socket.
        async with asyncio.timeout(5):
            while not _posted_results(fake) and fake.socket_results.empty():
                await asyncio.sleep(0.02)
        again = _posted_results(fake) or [await fake.socket_results.get()]
        assert again[0]["outbox_id"] == first["outbox_id"] == 1
        assert again[0]["outcome"] == "success"

    run_scenario(tmp_path, scenario, result_frames=True, socket_answers=["close"])


def test_an_outcome_rejected_over_the_socket_is_replaced_by_a_failure_naming_why(tmp_path):
    rejected = {"status": 422, "detail": "invalid result: output: too large"}

    async def scenario(fake: FakeServer, agent, agent_task) -> None:
        await fake.next_frame("hello")
        await fake.push(packet(1))
        first = await fake.socket_results.get()
        second = await fake.socket_results.get()
        assert first["outcome"] == "success"
        assert (second["outcome"], second["error_type"], second["output"]) == (
            "failure",
            "ResultRejected",
            None,
        )
        assert "output: too large" in second["error_message"]

    run_scenario(tmp_path, scenario, result_frames=True, socket_answers=[rejected])


def test_an_outcome_the_server_no_longer_wants_over_the_socket_is_let_go(tmp_path):
    unknown = {"status": 404, "detail": "work packet 1 was never addressed to this agent"}

    async def scenario(fake: FakeServer, agent, agent_task) -> None:
        await fake.next_frame("hello")
        await fake.push(packet(1))
        await fake.socket_results.get()
        await asyncio.sleep(0.3)
        assert fake.socket_results.empty() and _posted_results(fake) == []
        assert agent.intake.held == {}

    run_scenario(tmp_path, scenario, result_frames=True, socket_answers=[unknown])


def test_an_output_too_large_for_a_frame_goes_over_rest(tmp_path, monkeypatch):
    monkeypatch.setattr(outcome_reporter, "MAX_RESULT_FRAME_BYTES", 100)

    async def scenario(fake: FakeServer, agent, agent_task) -> None:
        await fake.next_frame("hello")
        await fake.push(packet(1, sleep_s=0.1))  # its frame is over 100 bytes
        assert (await fake.results.get())["outbox_id"] == 1
        assert fake.socket_results.empty()

    run_scenario(tmp_path, scenario, result_frames=True)


# -- batched frames (docs/agent-protocol.md, "Batched frames") ---------------------------


def test_a_batch_of_work_is_confirmed_in_one_frame_and_its_outcomes_acked(tmp_path):
    async def scenario(fake: FakeServer, agent, agent_task) -> None:
        hello = await fake.next_frame("hello")
        assert hello["batch_frames"] is True  # the agent takes batches from the server
        await fake.push_batch([packet(1), packet(2), packet(3)])
        async with asyncio.timeout(10):
            while agent.intake.reporter.answered_by_socket < 3 or agent.intake.held:
                await asyncio.sleep(0.02)
        confirmations = [m for m in fake.messages if "received" in _kinds(m)]
        assert confirmations == [
            {"type": "batch", "frames": [{"type": "received", "outbox_id": n} for n in (1, 2, 3)]}
        ]
        results = sorted(f["outbox_id"] for m in fake.messages for f in _inner(m)
                         if f["type"] == "result")  # fmt: skip
        assert results == [1, 2, 3]
        assert _posted_results(fake) == []

    run_scenario(tmp_path, scenario, result_frames=True, batch_frames=True)


def test_a_server_that_takes_no_batches_gets_one_frame_each(tmp_path):
    async def scenario(fake: FakeServer, agent, agent_task) -> None:
        await fake.next_frame("hello")
        await fake.push_batch([packet(1), packet(2)])  # it may still send them
        async with asyncio.timeout(10):
            while agent.intake.reporter.answered_by_socket < 2 or agent.intake.held:
                await asyncio.sleep(0.02)
        assert all(m["type"] != "batch" for m in fake.messages)
        kinds = [m["type"] for m in fake.messages if m["type"] != "heartbeat"]
        assert kinds.count("received") == 2 and kinds.count("result") == 2

    run_scenario(tmp_path, scenario, result_frames=True)


def test_outcomes_of_a_batch_unacknowledged_when_the_socket_drops_are_reported_again(tmp_path):
    async def scenario(fake: FakeServer, agent, agent_task) -> None:
        await fake.next_frame("hello")
        await fake.push_batch([packet(1), packet(2)])
        first = [await fake.socket_results.get()]  # answered by closing the socket
        # Every outcome out with it, batched or not, is reported again: over REST or the
        # next socket (whose hello still holds them).
        async with asyncio.timeout(10):
            while agent.intake.held:
                await asyncio.sleep(0.02)
        while not fake.socket_results.empty():
            first.append(fake.socket_results.get_nowait())
        again = [r["outbox_id"] for r in first[1:]] + [
            r["outbox_id"] for r in _posted_results(fake)
        ]
        assert first[0]["outbox_id"] in again
        assert sorted(set(again)) == [1, 2]

    run_scenario(
        tmp_path, scenario, result_frames=True, batch_frames=True, socket_answers=["close"]
    )


def _inner(message: dict) -> list[dict]:
    return message["frames"] if message["type"] == "batch" else [message]


def _kinds(message: dict) -> set[str]:
    return {f["type"] for f in _inner(message)}
