"""fleet/engine/batcher.py: a lone item on an idle batcher is written in its submitter's own
task (no turns of the event loop for the batching task); items that come together, or
while a write is in flight, still go as one batch."""

from __future__ import annotations

import asyncio

import pytest

from fleet.engine.batcher import Batcher


class Recorder:
    """A ``call`` that records each batch and the task it was started from; a write waits
    on ``gate`` (when set) so a test can hold a batch in flight."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.tasks: list[asyncio.Task | None] = []
        self.gate: asyncio.Event | None = None

    async def call(self, write, items):
        self.tasks.append(asyncio.current_task())
        if self.gate is not None:
            await self.gate.wait()
        self.batches.append(list(items))
        return write(items)


def doubled(items: list[int]) -> list[int]:
    return [item * 2 for item in items]


def test_it_writes_a_lone_item_in_the_submitters_task() -> None:
    async def scenario() -> None:
        recorder = Recorder()
        batcher = Batcher(doubled, 8, "test", recorder.call, lone_at_once=True)
        submitter = asyncio.create_task(batcher.submit(21))
        assert await submitter == 42
        assert recorder.batches == [[21]]
        assert recorder.tasks == [submitter]
        await batcher.close()

    asyncio.run(scenario())


def test_it_batches_what_arrives_while_a_write_is_in_flight() -> None:
    async def scenario() -> None:
        recorder = Recorder()
        recorder.gate = asyncio.Event()
        batcher = Batcher(doubled, 8, "test", recorder.call, lone_at_once=True)
        first = asyncio.create_task(batcher.submit(1))
        await asyncio.sleep(0)  # the first submitter waits its turn for company: none came
        await asyncio.sleep(0)  # its write is in flight, holding the only room
        later = [asyncio.create_task(batcher.submit(i)) for i in (2, 3, 4)]
        await asyncio.sleep(0)
        assert recorder.batches == []
        recorder.gate.set()
        assert await asyncio.gather(first, *later) == [2, 4, 6, 8]
        assert recorder.batches == [[1], [2, 3, 4]]
        assert recorder.tasks[0] is first and recorder.tasks[1] not in (first, *later)
        await batcher.close()

    asyncio.run(scenario())


def test_items_submitted_in_the_same_turn_are_written_as_one_batch() -> None:
    """The idle batcher's first item waits one turn for company: a burst is not split into
    a lone write and the rest (which would wait a whole round behind it)."""

    async def scenario() -> None:
        recorder = Recorder()
        batcher = Batcher(doubled, 8, "test", recorder.call, lone_at_once=True)
        submitters = [asyncio.create_task(batcher.submit(i)) for i in (1, 2, 3)]
        assert await asyncio.gather(*submitters) == [2, 4, 6]
        assert recorder.batches == [[1, 2, 3]]
        await batcher.close()

    asyncio.run(scenario())


def test_a_failed_lone_write_raises_in_its_submitter() -> None:
    def refuse(items: list[int]) -> list[int]:
        raise RuntimeError("database away")

    async def scenario() -> None:
        recorder = Recorder()
        batcher = Batcher(refuse, 8, "test", recorder.call, lone_at_once=True)
        with pytest.raises(RuntimeError, match="database away"):
            await batcher.submit(1)
        # The room was given back: the next lone item is written (and fails) too.
        with pytest.raises(RuntimeError, match="database away"):
            await asyncio.wait_for(batcher.submit(2), 5.0)
        assert recorder.batches == [[1], [2]]
        await batcher.close()

    asyncio.run(scenario())


def test_a_closed_batcher_writes_nothing_more() -> None:
    async def scenario() -> None:
        recorder = Recorder()
        batcher = Batcher(doubled, 8, "test", recorder.call, lone_at_once=True)
        await batcher.close()
        submitter = asyncio.create_task(batcher.submit(1))
        await asyncio.sleep(0.01)
        assert not submitter.done() and recorder.batches == []
        submitter.cancel()

    asyncio.run(scenario())


def test_without_lone_at_once_every_item_goes_through_the_batching_task() -> None:
    async def scenario() -> None:
        recorder = Recorder()
        batcher = Batcher(doubled, 8, "test", recorder.call)
        submitter = asyncio.create_task(batcher.submit(21))
        assert await submitter == 42
        assert recorder.batches == [[21]] and recorder.tasks[0] is not submitter
        await batcher.close()

    asyncio.run(scenario())


def test_alone_writes_a_lone_item_on_the_loop_and_its_none_falls_back_to_the_call() -> None:
    """``alone`` (the fleet's one-trip placement) answers a lone item without the ``call``
    thread; where it answers None the item is written by ``call`` as before; items that
    arrive while it is in flight wait for it and go as one batch through ``call``."""
    gate = asyncio.Event()
    seen: list[int] = []

    async def alone(item: int) -> int | None:
        seen.append(item)
        if item == 1:
            await gate.wait()
        return item * 10 if item % 2 else None

    async def scenario() -> None:
        recorder = Recorder()
        batcher = Batcher(doubled, 8, "test", recorder.call, lone_at_once=True, alone=alone)
        first = asyncio.create_task(batcher.submit(1))
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # the lone write is in flight on the loop, holding the room
        later = [asyncio.create_task(batcher.submit(i)) for i in (3, 5)]
        await asyncio.sleep(0)
        assert recorder.batches == []
        gate.set()
        assert await asyncio.gather(first, *later) == [10, 6, 10]
        assert recorder.batches == [[3, 5]]  # a batch never goes to ``alone``
        assert await batcher.submit(2) == 4  # None from ``alone``: written by ``call``
        assert recorder.batches == [[3, 5], [2]] and seen == [1, 2]
        await batcher.close()

    asyncio.run(scenario())
