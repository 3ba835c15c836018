"""The agent's answer to a push of a packet it already ran (agents/runtime/work_intake.py).

The server pushes a packet again when it reclaimed the packet of the agent's earlier
registration onto its current one (a server restart longer than the liveness window),
or after a lost ``received``.  The agent must never stay silent — the server would push
it for ever while the task stays Running — and never run it twice: it reports the kept
outcome again, under the agent id the push came through, or refuses the packet when it
no longer keeps the outcome.  The intake runs for real; its client, package cache and
task runner are stand-ins that record what they are asked (the HTTP boundary).
"""

from __future__ import annotations

import asyncio
from typing import Any

from agents.protocol import frames
from agents.runtime import recent_outcomes
from agents.runtime.client import ServerUnavailable
from agents.runtime.recent_outcomes import RecentOutcomes
from agents.runtime.work_intake import WorkIntake
from agents.sandbox.task_log import LogRing
from agents.sandbox.task_runner import RunOutcome
from tests.support.loop import run_async

DIGEST = "cd" * 32
TRIPLE = "x86_64-unknown-linux-gnu"
PACKET = {
    "outbox_id": 41,
    "task_execution_id": "7f9c2b1e-8a40-4f5e-9a53-2b0f7f7c1d11",
    "assignment": 2,
    "function": "pkg.steps:work",
    "context_json": "{}",
    "artifact_digest": DIGEST,
    "target_triple": TRIPLE,
    "timeout_s": 30.0,
    "task_name": "work",
}


class Client:
    """Answers every outcome 200 and remembers under which agent id it came."""

    def __init__(self) -> None:
        self.posted: list[tuple[str, dict[str, Any]]] = []

    async def post_result(self, agent_id: str, body: dict[str, Any]) -> tuple[int, dict]:
        self.posted.append((agent_id, body))
        return 200, {"applied": True, "reason": ""}


class Cache:
    def pin(self, digest: str) -> None:
        pass

    def unpin(self, digest: str) -> None:
        pass

    async def aget(self, digest: str, fetch) -> str:
        return "/nonexistent/package"


class Runner:
    """Each run returns a new output, so a wrongful second run shows in the outcome."""

    def __init__(self, output_bytes: int = 0) -> None:
        self.runs = 0
        self.output_bytes = output_bytes

    def new_log(self) -> LogRing:
        return LogRing(1024)

    async def run(
        self, package_dir, function, context_json, timeout_s, log=None, *, loop=None
    ) -> RunOutcome:
        self.runs += 1
        return RunOutcome(
            "success", {"run": self.runs}, duration_s=0.01, output_bytes=self.output_bytes
        )


def _intake(client: Client, runner: Runner, sent: list[dict]) -> WorkIntake:
    return WorkIntake(client, Cache(), runner, TRIPLE, 2, sent.append, lambda exc: None)


async def _settle(intake: WorkIntake) -> None:
    for _ in range(500):
        if intake.idle.is_set() and intake.reporter.pending == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the intake never settled")


def _scenario(runner: Runner) -> tuple[Client, Runner, list[dict], WorkIntake]:
    client, sent = Client(), []

    async def scenario() -> WorkIntake:
        intake = _intake(client, runner, sent)
        intake.on_work(dict(PACKET), "agent-old")
        await _settle(intake)
        # The server reclaimed the packet onto this process's new registration.
        intake.on_work(dict(PACKET, outbox_id=41), "agent-new")
        await _settle(intake)
        return intake

    intake = run_async(scenario())
    return client, runner, sent, intake


def test_a_repeated_push_of_a_reported_packet_is_answered_with_its_outcome_under_the_new_id():
    client, runner, sent, intake = _scenario(Runner())
    assert runner.runs == 1  # never run twice
    assert [agent for agent, _body in client.posted] == ["agent-old", "agent-new"]
    first, again = (body for _agent, body in client.posted)
    assert again == first  # the same outcome: output of the one run, same ids
    assert again["output"] == {"run": 1} and again["outcome"] == "success"
    # Both pushes were confirmed, so the server stops re-pushing.
    assert sent.count(frames.received(41)) == 2
    assert (PACKET["task_execution_id"], PACKET["assignment"]) in intake.recent


def test_a_repeated_push_names_the_outbox_row_it_came_as():
    client, sent = Client(), []

    async def scenario() -> None:
        intake = _intake(client, Runner(), sent)
        intake.on_work(dict(PACKET), "agent-1")
        await _settle(intake)
        intake.on_work(dict(PACKET, outbox_id=99), "agent-1")
        await _settle(intake)

    run_async(scenario())
    assert [body["outbox_id"] for _agent, body in client.posted] == [41, 99]
    assert frames.received(99) in sent


def test_a_repeated_push_whose_outcome_was_too_large_to_keep_is_refused(monkeypatch):
    monkeypatch.setattr(recent_outcomes, "MAX_KEPT_OUTCOME_BYTES", 1000)
    client, runner, sent, _intake_ = _scenario(Runner(output_bytes=5000))
    assert runner.runs == 1
    agent, refusal = client.posted[1]
    assert agent == "agent-new"
    assert refusal["outcome"] == "refused"
    assert "no longer kept" in refusal["error_message"]
    assert frames.received(41) in sent


def test_a_push_while_the_outcome_waits_for_the_server_moves_it_to_the_new_id():
    """The outcome is in hand (the server was away): the re-push says whom to report as."""

    class AwayClient(Client):
        def __init__(self) -> None:
            super().__init__()
            self.away = True
            self.tries = 0

        async def post_result(self, agent_id: str, body: dict) -> tuple[int, dict]:
            self.tries += 1
            if self.away:
                raise ServerUnavailable("connection refused")
            return await super().post_result(agent_id, body)

    client, runner, sent = AwayClient(), Runner(), []

    async def scenario() -> None:
        intake = _intake(client, runner, sent)
        intake.on_work(dict(PACKET), "agent-old")
        for _ in range(200):  # until its report was tried and refused
            if client.tries:
                break
            await asyncio.sleep(0.01)
        intake.on_work(dict(PACKET), "agent-new")
        client.away = False
        intake.reporter.server_is_back()
        await _settle(intake)

    run_async(scenario())
    assert runner.runs == 1
    assert [agent for agent, _body in client.posted] == ["agent-new"]
    assert sent.count(frames.received(41)) == 2


def test_recent_outcomes_are_bounded_by_count_and_bytes_oldest_first():
    recent = RecentOutcomes(max_entries=3, max_bytes=10_000)
    for i in range(5):
        recent.remember((f"t{i}", 1), {"i": i}, 600)
    assert len(recent) == 3
    assert ("t0", 1) not in recent and ("t4", 1) in recent
    assert recent.bytes == 1800

    small = RecentOutcomes(max_entries=100, max_bytes=2000)
    for i in range(4):
        small.remember((f"t{i}", 1), {"i": i}, 900)
    assert len(small) == 2 and small.bytes == 1800
    known, body, size = small.take(("t3", 1))
    assert known and body == {"i": 3} and size == 900
    assert small.bytes == 900 and ("t3", 1) not in small
    assert small.take(("t0", 1)) == (False, None, 0)


def test_an_outcome_too_large_to_keep_keeps_only_its_key():
    recent = RecentOutcomes(max_entries=10, max_bytes=10_000)
    recent.remember(("big", 1), {"output": "x"}, 50_000)
    known, body, size = recent.take(("big", 1))
    assert known and body is None and size == recent_outcomes.ENTRY_OVERHEAD_BYTES
