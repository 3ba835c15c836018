"""Waiting for a condition: the one polling loop every layer uses.

``wait_until`` polls from a plain test (threads, processes, HTTP); ``until`` is its
asyncio twin for tests that already run an event loop and read the database through
``sync_to_async``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout: float = 30.0,
    what: str = "condition",
    *,
    logs: Callable[[], str] | None = None,
    interval: float = 0.05,
) -> T:
    """``predicate()``'s first truthy value, polled every ``interval`` seconds.

    Fails after ``timeout`` naming ``what`` and, when given, the output of ``logs()`` (the
    tails of the processes involved), so a timeout explains itself.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what} not met after {timeout}s\n{logs() if logs else ''}".rstrip())


async def until(predicate: Callable[[], object], timeout: float = 3.0) -> None:
    """Await until ``predicate()`` (run in a thread: it may query the database) is truthy."""
    from asgiref.sync import sync_to_async

    deadline = asyncio.get_running_loop().time() + timeout
    while not await sync_to_async(predicate)():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)
