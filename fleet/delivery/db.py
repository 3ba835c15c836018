"""The shared database thread pool of the delivery path (sockets and the fleet executor).

Channels' ``database_sync_to_async`` closes the connection after every call
(``CONN_MAX_AGE = 0``), i.e. one new PostgreSQL connection per frame; the hot
paths (``received`` frames, heartbeats, dispatch) instead run on a small pool
of threads that keep their connection (:class:`fleet.engine.db_threads.DbThreadPool`).

These threads run the same few statements thousands of times a second, so their
connections bind parameters on the server and let psycopg prepare a statement
once it has run ``PREPARE_THRESHOLD`` times: planning was most of the database's
CPU per task (a claim: 0.5 ms planned each time, 0.1 ms prepared).  Everything
else in the process keeps Django's default (client-side binding, no prepared
statements).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from django.db import connection
from django.db.backends.postgresql.base import ServerBindingCursor

from fleet.engine.db_threads import DbThreadPool

T = TypeVar("T")

POOL_THREADS = 12  # dispatch placements, result applications, socket hellos
PREPARE_THRESHOLD = 2  # executions of one statement before psycopg prepares it

_lock = threading.Lock()
_pool: DbThreadPool | None = None


def pool() -> DbThreadPool:
    global _pool
    with _lock:
        if _pool is None:
            _pool = DbThreadPool(POOL_THREADS, "delivery-db")
        return _pool


def use_prepared_statements() -> None:
    """Switch this thread's connection to server-side binding with prepared statements
    (opening it if needed); a reconnected connection is switched again."""
    connection.ensure_connection()
    raw = connection.connection
    if raw.cursor_factory is not ServerBindingCursor:
        raw.cursor_factory = ServerBindingCursor
        raw.prepare_threshold = PREPARE_THRESHOLD
        # Recognisable in pg_stat_activity, like the relay's and the sockets' connections.
        with raw.cursor() as cursor:
            cursor.execute("SET application_name = 'cloacina-delivery'")


def _prepared(fn: Callable[..., T], *args: Any) -> T:
    use_prepared_statements()
    return fn(*args)


async def call(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` on a delivery pool thread."""
    return await pool().call(_prepared, fn, *args)


def close() -> None:
    """Close the pool's connections (shutdown, and between tests); a later call reopens it."""
    global _pool
    with _lock:
        current, _pool = _pool, None
    if current is not None:
        current.close()
