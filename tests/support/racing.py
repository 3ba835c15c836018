"""Threads released together against the test database, for races the locks must settle."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from django.db import connections

T = TypeVar("T")


def race(workers: int, target: Callable[[int], T]) -> list[T]:
    """Run ``target(index)`` in ``workers`` threads (each with its own connection) released
    together; their results in index order.  An exception in any thread fails the caller."""
    barrier = threading.Barrier(workers)
    results: list = [None] * workers
    errors: list = []

    def run(index: int) -> None:
        try:
            barrier.wait()
            results[index] = target(index)
        except Exception as exc:  # surfaced below, not lost in the thread
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results
