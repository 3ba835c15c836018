"""Calls from database threads to an event loop, many per wake-up.

``loop.call_soon_threadsafe`` writes a byte to the loop's self-pipe for every call,
and each write can wake the loop on its own.  A result batch alone made three
such calls (newly Ready tasks, the waiters' outcomes, the batch's own answer) and
every database call of the delivery pool two more objects and a wake-up of its own
(a ``concurrent.futures.Future`` with its lock and condition, chained to an asyncio
future).  Here every thread posts to the loop's one inbox: the first post after a
drain schedules the drain (one pipe write), the posts that follow before it runs
only append, and the drain runs them all in the order they were posted.

So the answer of a database call and the wake-ups it made on its way (ready events,
outcomes) reach the loop in one hop, in the order the thread made them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class LoopInbox:
    """Thread-safe: :meth:`post` from any thread, the calls run on ``loop``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._calls: list[tuple[Callable[..., Any], tuple]] = []
        self._scheduled = False
        self.drains = 0  # wake-ups of the loop (tests and measurements count them)
        self.posts = 0

    def post(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Run ``fn(*args)`` on the loop soon; False when the loop is closed (dropped)."""
        with self._lock:
            self._calls.append((fn, args))
            self.posts += 1
            if self._scheduled:
                return True
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody is left to run them
            with self._lock:
                self._calls.clear()
                self._scheduled = False
            return False
        return True

    def _drain(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
            self._scheduled = False
            self.drains += 1
        for fn, args in calls:
            try:
                fn(*args)
            except Exception:  # one bad callback must not cost the others their call
                log.exception("loop inbox: %r failed", fn)


_lock = threading.Lock()
_inboxes: dict[asyncio.AbstractEventLoop, LoopInbox] = {}


def inbox(loop: asyncio.AbstractEventLoop) -> LoopInbox:
    """``loop``'s inbox (made on first use; those of closed loops are forgotten)."""
    current = _inboxes.get(loop)
    if current is not None:
        return current
    with _lock:
        for old in [lp for lp in _inboxes if lp.is_closed()]:
            del _inboxes[old]
        current = _inboxes.get(loop)
        if current is None:
            current = _inboxes[loop] = LoopInbox(loop)
        return current


def resolve(future: asyncio.Future, value: Any) -> None:
    """Set ``future``'s result unless it is done (cancelled meanwhile): run on its loop."""
    if not future.done():
        future.set_result(value)


def reject(future: asyncio.Future, exc: BaseException) -> None:
    """Set ``future``'s exception unless it is done: run on its loop."""
    if not future.done():
        future.set_exception(exc)
