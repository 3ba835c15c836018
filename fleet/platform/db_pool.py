"""The server's PostgreSQL connection pool (psycopg_pool, through Django's ``OPTIONS["pool"]``).

Without it every HTTP request, and every ``database_sync_to_async`` call of a
socket, opened a PostgreSQL connection of its own and closed it again
(``CONN_MAX_AGE = 0``; under ASGI each request runs on a thread of its own, so
persistent connections would leak instead): a backend process forked and
authenticated, its catalog caches warmed, for a request that then ran a few
queries.  That was a fifth of the server's CPU in the in-process benchmark and
a good share of the database's.  Pooled, a request borrows a warm connection
and gives it back when Django "closes" it.

The pool is per process.  Threads that keep a connection for their lifetime
(:class:`fleet.engine.db_threads.DbThreadPool`) hold one each, so the automatic
size leaves room for them above what requests and jobs borrow.  A borrowed
connection is checked (one empty round trip) before use, so after a database
restart no request is handed a dead one.
"""

from __future__ import annotations

from typing import Any

from django.db.backends.postgresql.base import Cursor, ServerBindingCursor
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from psycopg.types.array import ListBinaryDumper, ListDumper

from fleet.platform.config import ConfigError

MIN_SIZE = 2
# Requests, sockets' sync calls, scheduler jobs and the dispatch tick, at once.
BORROWERS = 16
# The delivery path's threads (fleet.executors.fleet.delivery.db.POOL_THREADS) keep theirs.
DELIVERY_THREADS = 12
# Waiting longer than this for a free connection is an error (the pool is too small
# for the load, or connections leak), not a reason to hang a request forever.
CHECKOUT_TIMEOUT_S = 30.0
# While the server stops: a database that is gone must not hold each shutdown step for
# CHECKOUT_TIMEOUT_S (four such steps kept a SIGTERM'd server up for a minute and more).
SHUTDOWN_CHECKOUT_TIMEOUT_S = 2.0


# Fewest borrowers a configured pool must leave room for beyond the threads that keep one.
MIN_BORROWERS = 4


def pool_size(configured: int, worker_processes: int) -> int:
    """``configured``, or (0) room for the in-process executor's threads (two per
    worker), the delivery threads and the borrowers.  A configured size too small for the
    threads that keep a connection would leave them waiting on each other: refused."""
    held = 2 * worker_processes + DELIVERY_THREADS
    if not configured:
        return held + BORROWERS
    if configured < held + MIN_BORROWERS:
        raise ConfigError(
            f"CLOACINA_DB_POOL_MAX must be at least {held + MIN_BORROWERS} with "
            f"{worker_processes} worker processes (the executors' database threads keep "
            f"{held} connections), got {configured}"
        )
    return configured


def pool_options(max_size: int) -> dict:
    """Django's ``OPTIONS["pool"]`` for a pool of at most ``max_size`` connections."""
    return {
        "min_size": min(MIN_SIZE, max_size),
        "max_size": max_size,
        "timeout": CHECKOUT_TIMEOUT_S,
        "reset": reset_session,
    }


def shorten_checkout(timeout_s: float = SHUTDOWN_CHECKOUT_TIMEOUT_S) -> None:
    """From now on a borrow waits at most ``timeout_s`` for a connection (the shutdown's
    steps: a database that is gone fails them fast instead of one pool timeout each)."""
    from django.db import connection

    pool = connection.pool
    if pool is not None:
        pool.timeout = min(pool.timeout, timeout_s)


def close_pool() -> None:
    """Close this process's pool at the end of a shutdown.  Borrowers still waiting (a
    periodic job that started before the database went away) fail at once with
    ``PoolClosed`` instead of holding the process's exit for their whole timeout."""
    from django.db import connection

    if connection.pool is not None:
        connection.close_pool()


def reset_session(conn) -> None:
    """Called by the pool on every connection given back: undo what a hot-path thread
    changed (:func:`fleet.engine.db_threads.use_prepared_statements`), so the next
    borrower gets Django's defaults.  A no-op for the common, untouched connection."""
    if conn.cursor_factory is ServerBindingCursor:
        conn.cursor_factory = Cursor
        conn.prepare_threshold = None
        binary_lists(conn, False)
        conn.execute("RESET application_name; RESET plan_cache_mode")


def binary_lists(conn: Any, binary: bool) -> None:
    """Make ``%s`` dump a Python list as a binary array on this psycopg connection (a
    hot-path thread's: :func:`fleet.engine.db_threads.use_prepared_statements`), or, with
    ``binary=False``, as text again (psycopg's default: its text dumper registered last).
    A binary array is typed by its elements (a list of ``str`` is ``text[]``, not an
    untyped literal), so a hot statement casts an array it compares with another type
    (``%(ids)s::uuid[]``)."""
    conn.adapters.register_dumper(list, ListBinaryDumper if binary else ListDumper)


class PoolCollector:
    """This process's pool on /metrics (per process, like the dispatch histogram):
    connections open and idle, borrowers waiting now, and the totals of borrows that
    waited, timed out, and connections opened or lost."""

    _GAUGES = (
        ("cloacina_db_pool_connections", "pool_size", "PostgreSQL connections the pool holds."),
        ("cloacina_db_pool_idle", "pool_available", "Pooled connections idle, ready to lend."),
        ("cloacina_db_pool_max", "pool_max", "Most connections the pool may hold."),
        ("cloacina_db_pool_waiting", "requests_waiting", "Borrowers waiting for a connection."),
    )
    _COUNTERS = (
        ("cloacina_db_pool_borrows_queued", "requests_queued", "Borrows that had to wait."),
        ("cloacina_db_pool_borrow_errors", "requests_errors", "Borrows that failed or timed out."),
        ("cloacina_db_pool_connections_opened", "connections_num", "Connections opened."),
        ("cloacina_db_pool_connections_lost", "connections_lost", "Connections found broken."),
    )

    def describe(self):
        # Without describe() the registry would call collect() at registration.
        return [GaugeMetricFamily(name, doc) for name, _key, doc in self._GAUGES] + [
            CounterMetricFamily(name, doc) for name, _key, doc in self._COUNTERS
        ]

    def collect(self):
        from django.db import connection

        pool = connection.pool
        if pool is None:  # no pool configured (a DB-less agent)
            return
        stats = pool.get_stats()
        for name, key, doc in self._GAUGES:
            yield GaugeMetricFamily(name, doc, value=stats.get(key, 0))
        for name, key, doc in self._COUNTERS:
            yield CounterMetricFamily(name, doc, value=stats.get(key, 0))
