"""Coalescing many small database writes of the event loop into batches on a DB thread.

Items are submitted from coroutines; whatever arrives while a batch is being
written becomes the next batch (up to ``max_batch``), written by ONE call of
``write(items) -> answers`` on a database thread (``call``: the delivery pool's,
or an executor's own :class:`~fleet.engine.db_threads.DbThreadPool`).  Nothing waits for a batch
to fill: on an idle server a lone item is written at once, so batching costs no
latency, and under load the cost of a round trip, a statement's planning and a
commit is shared by every item of the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

I = TypeVar("I")  # noqa: E741 - an item
A = TypeVar("A")  # its answer


class Batcher(Generic[I, A]):
    """``concurrency`` batches may be written at once (each on its own pool thread and
    connection): only for writes whose transactions cannot deadlock one another.

    ``lone_at_once``: a lone item is written in its submitter's task (see :meth:`submit`);
    ``alone`` (a coroutine on the event loop) writes it there first when given, its None
    meaning "not here": the item then goes to the ``call`` thread as usual.
    For latency-bound writes that come one at a time when idle (the fleet's placement);
    not for writes whose batches grow only in the turns they wait (the in-process
    executor's outcomes, one child at a time: alone, each would cost a commit)."""

    def __init__(
        self,
        write: Callable[[list[I]], list[A]],
        max_batch: int,
        name: str,
        call: Callable[..., Awaitable[Any]],
        concurrency: int = 1,
        lone_at_once: bool = False,
        alone: Callable[[I], Awaitable[A | None]] | None = None,
    ) -> None:
        self._write_batch = write
        self._lone_at_once = lone_at_once
        self._alone = alone
        self._call = call
        self._max_batch = max_batch
        self._name = name
        self.loop = asyncio.get_running_loop()
        self._pending: list[tuple[I, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._room = asyncio.Semaphore(concurrency)
        self._writes: set[asyncio.Task] = set()
        self._task = asyncio.create_task(self._run(), name=name)
        self.batches = 0
        self.items = 0

    async def submit(self, item: I) -> A:
        """``item``'s answer once its batch is written (its exception if the write failed).

        With ``lone_at_once``, an item that finds the batcher idle (nothing waiting, room
        for a write) waits one turn of the event loop for company; still alone then, it is
        written in the caller's own task.  Through the batching task it would wait two
        turns (waking that task, then starting a task for the write) before the database
        thread even hears of it: an idle pickup's latency, and on a busy loop each turn is
        long.  Items that joined it in that turn go through the batching task together, as
        one batch, as before: a lone write must not make a burst that arrives with it wait
        a whole round."""
        future = self.loop.create_future()
        self._pending.append((item, future))
        if self._lone_at_once and len(self._pending) == 1 and not self._room.locked():
            try:
                await asyncio.sleep(0)  # the submitters of this same turn may join
            except asyncio.CancelledError:
                self._wake.set()  # its item stays queued: the batching task writes it
                raise
            if (
                self._lone_at_once  # not closed meanwhile
                and len(self._pending) == 1
                and self._pending[0][1] is future
                and not self._room.locked()
            ):
                self._pending.clear()
                return await self._write_alone(item, future)
        self._wake.set()
        return await future

    async def _write_alone(self, item: I, future: asyncio.Future) -> A:
        await self._room.acquire()  # there is room and nobody waits: returns at once
        try:
            if self._alone is not None:
                # Written on the event loop itself when it can be (no thread hop); its None
                # sends the item down the usual path.  Items arriving meanwhile wait for the
                # room, as behind any write.
                answer = await self._alone(item)
                if answer is not None:
                    self.batches += 1
                    self.items += 1
                    future.set_result(answer)
            if not future.done():
                await self._write([(item, future)])
        finally:
            self._room.release()
        return future.result()  # its exception when the write failed

    async def submit_many(self, items: list[I]) -> list[A | BaseException]:
        """Each item's answer (or the exception its batch failed with), in order: one wait
        for a group of items that arrived together."""
        futures = [self.loop.create_future() for _ in items]
        self._pending.extend(zip(items, futures, strict=True))
        self._wake.set()
        return await asyncio.gather(*futures, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                await self._room.acquire()
                # Taken only once there is room: what arrived meanwhile joins this batch.
                batch = self._pending[: self._max_batch]
                del self._pending[: self._max_batch]
                write = asyncio.create_task(self._write(batch))
                self._writes.add(write)
                write.add_done_callback(self._written)

    def _written(self, write: asyncio.Task) -> None:
        self._writes.discard(write)
        self._room.release()

    async def _write(self, batch: list[tuple[I, asyncio.Future]]) -> None:
        try:
            answers = await self._call(self._write_batch, [item for item, _ in batch])
        except asyncio.CancelledError:
            for _, future in batch:
                future.cancel()
            raise
        except Exception as exc:
            log.warning("%s: a batch of %d failed: %s", self._name, len(batch), exc)
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        self.batches += 1
        self.items += len(batch)
        for (_, future), answer in zip(batch, answers, strict=True):
            if not future.done():  # its submitter may have been cancelled meanwhile
                future.set_result(answer)

    async def close(self) -> None:
        """Stop writing; items not yet taken are cancelled."""
        self._lone_at_once = False  # nothing is written after a close
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        for write in list(self._writes):
            write.cancel()
        await asyncio.gather(*self._writes, return_exceptions=True)
        for _, future in self._pending:
            future.cancel()
        self._pending = []
