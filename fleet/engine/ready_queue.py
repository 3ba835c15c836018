"""Hand newly Ready tasks to this process's dispatch loop, if one is running.

The result endpoint, the scheduler and the API run in request threads; the
dispatch loop lives on the event loop.  When no loop is registered (a
management command, a unit test) events are dropped here and the scheduler's
periodic tick finds the Ready rows instead: the database is the truth, this
is only the fast path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from agents.protocol import hop_trace
from fleet.engine.events import TaskReadyEvent

_lock = threading.Lock()
_sink: Callable[[list[TaskReadyEvent]], None] | None = None


def register(sink: Callable[[list[TaskReadyEvent]], None] | None) -> None:
    """Install (or with None remove) the callable that receives events; it must be thread-safe."""
    global _sink
    with _lock:
        _sink = sink


def submit(events: Iterable[TaskReadyEvent]) -> None:
    batch = list(events)
    if not batch:
        return
    hop_trace.mark_many("submitted", [event.task_execution_id for event in batch])
    with _lock:
        sink = _sink
    if sink is not None:
        sink(batch)
