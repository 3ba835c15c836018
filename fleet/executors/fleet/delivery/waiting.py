"""Waiting with a timeout that never swallows a cancellation.

``asyncio.wait_for`` on Python 3.11 can lose an outer ``cancel()`` that lands
while its timeout fires (the task then never stops — seen as a hung
shutdown); ``asyncio.timeout`` counts cancellations and tells the two apart.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``event``; whether it was set."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def wait_or_none(awaitable: Awaitable[T], timeout: float) -> T | None:
    """The awaitable's result, or None after ``timeout`` seconds (the awaitable is shielded:
    a future waited on again later is not cancelled by the timeout)."""
    try:
        async with asyncio.timeout(timeout):
            return await asyncio.shield(awaitable)
    except TimeoutError:
        return None
