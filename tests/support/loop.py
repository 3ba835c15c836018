"""Run a test's asyncio code on a fresh event loop in a thread of its own.

A session-wide fixture (Playwright's sync API) may leave a loop running in the
main test thread, where ``asyncio.run`` and pytest-asyncio both refuse to
start another; a private thread always has none.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


def run_async(awaitable: Awaitable[T]) -> T:
    """``asyncio.run(awaitable)`` in a new thread; returns its result or raises its error."""
    outcome: dict[str, Any] = {}

    async def main() -> T:
        return await awaitable

    def target() -> None:
        try:
            outcome["result"] = asyncio.run(main())
        except BaseException as exc:  # re-raised in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="test-event-loop")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def in_own_loop(test: Callable[..., Awaitable[T]]) -> Callable[..., T]:
    """Decorate an ``async def`` test so it runs through :func:`run_async` (fixtures still apply)."""

    @functools.wraps(test)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        return run_async(test(*args, **kwargs))

    return wrapper
