"""The agent's protocol edges that the real server never produces on demand, against a tiny
fake: a real WebSocket server (``websockets.serve``) for delivery and an httpx MockTransport
for REST.  The agent, its task runner (real child processes) and its package cache are real.

The behaviour the real server does exercise (drain, reconnect, refusal, re-push) is tested
against it in test_agent_runtime_e2e.py.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from agents.runtime.agent import EXIT_AUTH, EXIT_OK, Agent
from tests.support.fakes.agent_server import (
    FakeServer,
    packet,
    run_scenario,
)


def test_hello_reports_the_tasks_in_hand_after_a_reconnect(tmp_path):
    async def scenario(fake: FakeServer, agent: Agent, agent_task) -> None:
        assert (await fake.next_frame("hello"))["holding"] == []
        work = packet(1, sleep_s=1.5)
        await fake.push(work)
        assert (await fake.next_frame("received"))["outbox_id"] == 1
        await fake.sockets[-1].close(1011, "server going away")
        hello = await fake.next_frame("hello")
        assert hello["holding"] == [[work["task_execution_id"], 1]]
        result = await fake.results.get()
        assert (result["outcome"], result["output"]) == ("success", {"napped": 1.5})
        assert fake.agent_ids and len(fake.agent_ids) == 1  # a reconnect, not a re-registration

    run_scenario(tmp_path, scenario)


def test_a_draining_agent_refuses_new_packets_and_finishes_the_one_in_hand(tmp_path):
    async def scenario(fake: FakeServer, agent: Agent, agent_task) -> None:
        await fake.next_frame("hello")
        await fake.push(packet(1, sleep_s=1.0))
        await fake.next_frame("received")
        agent.request_drain("test")
        await fake.push(packet(2))
        await fake.next_frame("received")  # even a refused packet is confirmed as received
        first = await fake.results.get()
        assert (first["outbox_id"], first["outcome"], first["error_message"]) == (
            2,
            "refused",
            "agent draining",
        )
        second = await fake.results.get()
        assert (second["outbox_id"], second["outcome"]) == (1, "success")
        assert await agent_task == EXIT_OK
        assert fake.paths()[-1] == f"/agents/{fake.agent_ids[0]}/deregister"

    run_scenario(tmp_path, scenario)


def test_a_draining_agent_the_server_lets_go_does_not_register_again(tmp_path, caplog):
    async def scenario(fake: FakeServer, agent: Agent, agent_task) -> None:
        await fake.next_frame("hello")
        await fake.push(packet(1, sleep_s=1.0))
        await fake.next_frame("received")
        agent.request_drain("test")
        # The server forgets it mid-drain (as its own deregistration's close can arrive
        # before the answer): the task in hand is still reported, then the agent leaves.
        await fake.sockets[-1].close(4404, "agent is stopped; register again")
        assert (await fake.results.get())["outcome"] == "success"
        assert await agent_task == EXIT_OK
        assert len(fake.agent_ids) == 1  # no second registration
        assert len(fake.sockets) == 1

    with caplog.at_level(logging.INFO, logger="cloacina.agent"):
        run_scenario(tmp_path, scenario)
    # A normal end of a drain, not a warning that the server lost the agent.
    assert "let this draining agent go" in caplog.text
    assert "no longer knows this agent" not in caplog.text


def test_a_missing_artifact_is_a_refusal_not_a_task_failure(tmp_path):
    async def scenario(fake: FakeServer, agent: Agent, agent_task) -> None:
        await fake.next_frame("hello")
        await fake.push(packet(1, artifact_digest="cd" * 32))
        result = await fake.results.get()
        assert result["outcome"] == "refused"
        assert "cd" * 32 in result["error_message"] and "404" in result["error_message"]

    run_scenario(tmp_path, scenario)


def test_a_cached_artifact_is_not_fetched_again_and_a_repush_is_not_run_again(tmp_path):
    async def scenario(fake: FakeServer, agent: Agent, agent_task) -> None:
        await fake.next_frame("hello")
        await fake.push(packet(1, sleep_s=0.5))
        await fake.push(packet(1, sleep_s=0.5))  # the same (task, assignment) again
        first = await fake.results.get()
        assert first["outbox_id"] == 1
        await fake.push(packet(2))
        assert (await fake.results.get())["outbox_id"] == 2
        # A late re-push of one already reported (sleep_s 0 would show in a re-run's
        # output): answered with the outcome of its one run, never run again.
        await fake.push(packet(1))
        again = await fake.results.get()
        assert again == first and again["output"] == {"napped": 0.5}
        await fake.push(packet(3))
        assert (await fake.results.get())["outbox_id"] == 3
        await asyncio.sleep(0.3)  # room for a wrongful re-run of packet 1 to report
        assert fake.results.empty()
        assert fake.artifact_fetches == 1

    run_scenario(tmp_path, scenario)


def test_a_malformed_packet_is_refused_naming_the_field(tmp_path):
    async def scenario(fake: FakeServer, agent: Agent, agent_task) -> None:
        await fake.next_frame("hello")
        await fake.push(packet(1, function=None))
        result = await fake.results.get()
        assert result["outcome"] == "refused"
        assert result["error_message"] == "malformed work packet: missing function"

    run_scenario(tmp_path, scenario)


@pytest.mark.parametrize("code", [4401, 4403])
def test_a_socket_closed_for_a_bad_key_stops_the_agent(tmp_path, code):
    async def scenario(fake: FakeServer, agent: Agent, agent_task) -> None:
        await fake.next_frame("hello")
        await fake.sockets[-1].close(code, "invalid or revoked API key")
        assert await agent_task == EXIT_AUTH
        assert "revoked" in agent.exit_message

    run_scenario(tmp_path, scenario)


def test_a_task_past_its_timeout_is_killed_and_reported_as_a_failure(tmp_path):
    async def scenario(fake: FakeServer, agent: Agent, agent_task) -> None:
        await fake.next_frame("hello")
        await fake.push(packet(1, sleep_s=30, timeout_s=0.5))
        result = await fake.results.get()
        assert (result["outcome"], result["error_type"]) == ("failure", "TaskTimeout")
        assert "0.5s timeout" in result["error_message"]
        await fake.push(packet(2))  # the slot is usable again (a fresh child)
        assert (await fake.results.get())["outcome"] == "success"

    run_scenario(tmp_path, scenario)


def test_an_agent_registers_on_the_socket_and_keeps_it_for_the_session(tmp_path):
    async def scenario(fake: FakeServer, agent: Agent, agent_task) -> None:
        await fake.next_frame("hello")
        assert [(method, path) for method, path, _body in fake.calls] == [
            ("WS", "/agents/register")
        ]
        # One connection: the registering socket carried the hello.
        assert len(fake.sockets) == 1
        assert fake.sockets[0].request.path == "/ws/agents/"

    run_scenario(tmp_path, scenario)


def test_an_older_server_without_the_registering_socket_is_registered_with_over_rest(tmp_path):
    async def scenario(fake: FakeServer, agent: Agent, agent_task) -> None:
        await fake.next_frame("hello")
        await fake.sockets[-1].close(4404, "agent is dead; register again")
        await fake.next_frame("hello")
        registrations = [(m, p) for m, p, _body in fake.calls if p == "/agents/register"]
        # Over REST both times: the refused handshake is remembered for that server.
        assert registrations == [("POST", "/agents/register")] * 2
        assert len(fake.agent_ids) == 2
        assert fake.sockets[-1].request.path == f"/ws/agents/{fake.agent_ids[-1]}/"

    run_scenario(tmp_path, scenario, socket_registration=False)
