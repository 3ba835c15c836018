"""The agent's event loop is looked up once per task, not once per step of it.

On Python 3.11 ``asyncio.get_running_loop()`` makes a ``getpid`` system call; a task's
intake, run, live tail and report looked the loop up six times, the largest share of the
agent's system calls per task in the drain (docs/performance.md, "Round i17-agent
(session 16)").  The intake now looks it up as the packet arrives and hands it down.
The intake, reporter and live tail run for real; the task runner and the delivery socket
are stand-ins.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from agents.runtime.work_intake import WorkIntake
from agents.sandbox.task_log import LogRing
from agents.sandbox.task_runner import RunOutcome
from tests.support.loop import run_async
from tests.unit.test_agent_repeated_push import PACKET, TRIPLE, Cache, Client


class Runner:
    """Records the loop each run was handed."""

    def __init__(self) -> None:
        self.loops: list[object] = []

    def new_log(self) -> LogRing:
        return LogRing(1024)

    async def run(
        self, package_dir, function, context_json, timeout_s, log=None, *, loop=None
    ) -> RunOutcome:
        self.loops.append(loop)
        return RunOutcome("success", {"ok": True}, duration_s=0.001)


class Socket:
    """A delivery session that answers every ``result`` with a ``result_ack`` at once."""

    wire_format = "json"

    def __init__(self) -> None:
        self.intake: WorkIntake | None = None
        self.results: list[int] = []

    def send_soon(self, data: str | bytes) -> bool:
        frame = json.loads(data)
        self.results.append(frame["outbox_id"])
        ack = {"type": "result_ack", "outbox_id": frame["outbox_id"], "status": 200}
        self.intake.reporter._acks.answer({**ack, "applied": True})
        return True


@pytest.fixture
def lookups(monkeypatch) -> list[int]:
    """Counts ``get_running_loop()`` as the agent's modules and asyncio's ``create_task``
    call it (``asyncio.get_running_loop`` is ``asyncio.events.get_running_loop``)."""
    count = [0]
    real = asyncio.events.get_running_loop

    def counting() -> asyncio.AbstractEventLoop:
        count[0] += 1
        return real()

    monkeypatch.setattr(asyncio, "get_running_loop", counting)
    monkeypatch.setattr(asyncio.events, "get_running_loop", counting)
    return count


def test_a_task_looks_its_loop_up_once_from_push_to_acknowledged_result(lookups):
    runner, socket, sent = Runner(), Socket(), []

    async def scenario() -> tuple[object, int]:
        intake = WorkIntake(
            Client(),
            Cache(),
            runner,
            TRIPLE,
            2,
            sent.append,
            lambda exc: None,
            result_socket=lambda agent_id: socket,
            send_log=lambda agent_id, frame: asyncio.sleep(0),  # a live tail per run
        )
        socket.intake = intake
        loop = asyncio.events._get_running_loop()  # not counted
        before = lookups[0]
        for n in range(3):
            packet = dict(
                PACKET,
                outbox_id=100 + n,
                task_execution_id=f"{n:08d}" + PACKET["task_execution_id"][8:],
            )
            intake.on_work(packet, "agent-1")
            await intake.idle.wait()  # settled: its result acknowledged over the socket
        return loop, lookups[0] - before

    loop, looked_up = run_async(scenario())
    assert socket.results == [100, 101, 102]
    assert runner.loops == [loop, loop, loop]  # handed down, the running one
    assert looked_up == 3  # main: 6 per task (create_task twice, tail, ack wait and timer)
