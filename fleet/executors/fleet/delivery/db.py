"""The shared database thread pool of the delivery path (sockets and the fleet executor).

Channels' ``database_sync_to_async`` closes the connection after every call
(``CONN_MAX_AGE = 0``), i.e. one new PostgreSQL connection per frame; the hot
paths (``received`` frames, heartbeats, dispatch) instead run on a small pool
of threads that keep their connection (:class:`fleet.engine.db_threads.DbThreadPool`).

Its threads run the same few statements thousands of times a second: their
connections prepare them (``hot_path``, see :mod:`fleet.engine.db_threads`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from fleet.engine.db_threads import DbThreadPool

T = TypeVar("T")

POOL_THREADS = 12  # dispatch placements, result applications, socket hellos

_lock = threading.Lock()
_pool: DbThreadPool | None = None


def pool() -> DbThreadPool:
    global _pool
    with _lock:
        if _pool is None:
            _pool = DbThreadPool(POOL_THREADS, "delivery-db", hot_path="cloacina-delivery")
        return _pool


async def call(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` on a delivery pool thread."""
    return await pool().call(fn, *args)


def close() -> None:
    """Close the pool's connections (shutdown, and between tests); a later call reopens it."""
    global _pool
    with _lock:
        current, _pool = _pool, None
    if current is not None:
        current.close()
