"""fleet/engine/loop.py: a thread that hands the idle dispatch loop a Ready task steps aside
(sleeps briefly, releasing the GIL) so the loop takes the task at once, instead of after
the thread's own remaining work (an API start's response); never on the loop's own thread,
and not when the loop already has work."""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest

from fleet.engine import loop as engine_loop
from fleet.engine.dispatcher import Dispatcher
from fleet.engine.events import TaskReadyEvent
from fleet.engine.loop import EngineLoop


def event() -> TaskReadyEvent:
    return TaskReadyEvent(uuid.uuid4(), uuid.uuid4(), "a", 1, tenant_id=1)


@pytest.fixture
def asides(monkeypatch) -> list[str]:
    seen: list[str] = []
    monkeypatch.setattr(engine_loop, "step_aside", lambda: seen.append("aside"))
    return seen


async def accepting(engine: EngineLoop) -> None:
    """The loop's side of start() that submit_threadsafe reads, without workers or tick."""
    engine._loop = asyncio.get_running_loop()
    engine._loop_thread = threading.get_ident()
    engine._accepting = True


def from_thread(engine: EngineLoop, events: list[TaskReadyEvent]) -> None:
    thread = threading.Thread(target=engine.submit_threadsafe, args=(events,))
    thread.start()
    thread.join()


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_a_thread_steps_aside_when_it_hands_the_idle_loop_work(asides):
    engine = EngineLoop(Dispatcher(claimer="handoff-test"), poll_s=1.0, concurrency=1)

    async def scenario() -> int:
        await accepting(engine)
        await asyncio.to_thread(from_thread, engine, [event()])
        await settle()
        return engine.pending()

    assert asyncio.run(scenario()) == 1  # the event was offered on the loop
    assert asides == ["aside"]


def test_no_step_aside_on_the_loops_own_thread_or_when_it_has_work(asides):
    engine = EngineLoop(Dispatcher(claimer="handoff-test"), poll_s=1.0, concurrency=1)

    async def scenario() -> int:
        await accepting(engine)
        engine.submit_threadsafe([event()])  # on the loop's thread: never sleeps there
        await settle()
        await asyncio.to_thread(from_thread, engine, [event()])  # one is queued already
        await settle()
        return engine.pending()

    assert asyncio.run(scenario()) == 2
    assert asides == []


def test_stepping_aside_is_a_short_sleep(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(engine_loop.time, "sleep", slept.append)
    engine_loop.step_aside()
    assert slept == [engine_loop.HANDOFF_YIELD_S] and 0 < engine_loop.HANDOFF_YIELD_S < 0.001
