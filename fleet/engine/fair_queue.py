"""A round-robin queue of TaskReadyEvents: one workflow execution at a time, in turn.

Plain FIFO hands the dispatch workers a burst of sibling tasks of one
execution together; their outcomes then queue up on that execution's row
lock (the result handler advances one execution at a time).  Taking one
event per execution in turn spreads concurrent runs over executions, and
keeps one huge execution from starving the small ones queued after it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque

from fleet.engine.events import TaskReadyEvent


class FairQueue:
    def __init__(self) -> None:
        self._by_execution: dict[uuid.UUID, deque[TaskReadyEvent]] = {}
        self._turns: deque[uuid.UUID] = deque()  # executions with queued events, in turn order
        self._items = asyncio.Semaphore(0)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def put_nowait(self, event: TaskReadyEvent) -> None:
        key = event.workflow_execution_id
        queue = self._by_execution.get(key)
        if queue is None:
            queue = self._by_execution[key] = deque()
            self._turns.append(key)
        queue.append(event)
        self._size += 1
        self._items.release()

    async def get(self) -> TaskReadyEvent:
        await self._items.acquire()
        key = self._turns.popleft()
        queue = self._by_execution[key]
        event = queue.popleft()
        if queue:
            self._turns.append(key)  # its next event waits for every other execution's turn
        else:
            del self._by_execution[key]
        self._size -= 1
        return event
