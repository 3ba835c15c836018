"""A fixed pool of threads for an executor's synchronous ORM work, each with its own connection.

Why not ``sync_to_async``: its thread-sensitive mode funnels every call through
one thread (a bottleneck for a busy executor), and its other mode borrows the
loop's default executor, whose threads and connections nobody ever closes.
Here each thread keeps its connection between calls (no reconnect per task),
drops it when it breaks (a database restart), and closes it on :meth:`close`,
so a test database can be dropped and a server shuts down cleanly.

A pool made with ``hot_path=`` names its connections (pg_stat_activity shows
whose they are) and binds parameters on the server, letting psycopg prepare a
statement once it has run ``PREPARE_THRESHOLD`` times: the hot paths run the
same few statements thousands of times a second, and planning them each time
was most of the database's CPU per task (a claim: 0.5 ms planned, 0.1 ms
prepared).  Its prepared statements take their generic plan at once
(``plan_cache_mode = force_generic_plan``): PostgreSQL's default plans a prepared
statement's first five executions for their parameters before it settles on the generic
plan every hot statement ends on, and with twelve threads each planning each hot statement
that way, a fresh server's first 2,000 tasks (fleetbench's burst) paid ~0.09 ms of
database CPU per task for it (docs/performance.md, "Round i17-burst5").  Such a
connection also sends list parameters (the hot statements' ``unnest`` and ``ANY``
arrays) in PostgreSQL's binary array format: psycopg's text format quotes and escapes
every element in Python, a regular-expression call per ``"`` or ``\\`` of a packet's JSON,
which made a placement's arrays ~0.08 ms of server CPU per task under load
(docs/performance.md, "Round i17-cpu2").  Everything else in the process keeps
Django's default (client-side binding, no prepared statements, text arrays);
:func:`fleet.platform.db_pool.reset_session` undoes the switches when such a connection goes
back to the connection pool.

:meth:`DbThreadPool.call` (the event loop's way in) hands over an asyncio future and
gets the answer back through the loop's inbox (:mod:`fleet.engine.loop_inbox`): no
``concurrent.futures.Future`` per call, and the answers of several threads, with the
wake-ups their work made, reach the loop in one hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from django.db import connection, connections
from django.db.backends.postgresql.base import ServerBindingCursor

from fleet.engine import loop_inbox
from fleet.platform.db_pool import binary_lists

log = logging.getLogger(__name__)

T = TypeVar("T")

THREAD_JOIN_TIMEOUT_S = 10.0
# Executions of one statement before psycopg prepares it: one unprepared run (planned),
# then prepared at the second, so a statement run once is not kept on the server.
PREPARE_THRESHOLD = 1
# The hot statements' generic plans are what PostgreSQL's default settles on after five
# custom plans anyway (their binds take ~0.03 ms once it has); skip the five.
PLAN_CACHE_MODE = "force_generic_plan"


def use_prepared_statements(application_name: str) -> None:
    """Switch this thread's connection to server-side binding with prepared statements on
    their generic plans, named ``application_name`` (opening it if needed); a new
    connection is switched again."""
    connection.ensure_connection()
    raw = connection.connection
    if raw.cursor_factory is not ServerBindingCursor:
        raw.cursor_factory = ServerBindingCursor
        raw.prepare_threshold = PREPARE_THRESHOLD
        binary_lists(raw, True)
        with raw.cursor() as cursor:
            cursor.execute(
                "SELECT set_config('application_name', %s, false), "
                "set_config('plan_cache_mode', %s, false)",
                [application_name, PLAN_CACHE_MODE],
            )


def _drop_broken_connection() -> None:
    # After an error the connection may be dead (server restart) or stuck in a failed
    # transaction; a fresh one on the next call is cheaper than guessing.
    with contextlib.suppress(Exception):
        if connection.connection is not None and (
            connection.in_atomic_block or not connection.is_usable()
        ):
            connection.close()


class DbThreadPool:
    def __init__(self, size: int, name: str, hot_path: str = "") -> None:
        """``hot_path``: the application name of prepared-statement connections (see the
        module docstring); empty for Django's defaults."""
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self._hot_path = hot_path
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(size)
        ]
        self._closed = False
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        if self._closed:
            raise RuntimeError("the database thread pool is closed")
        future: Future[T] = Future()
        self._jobs.put((future, fn, args))
        return future

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on a pool thread and await its result.  Cancelled before a
        thread takes it, the call does not run; once running, it runs to its end."""
        if self._closed:
            raise RuntimeError("the database thread pool is closed")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._jobs.put((_Answer(future, loop_inbox.inbox(loop)), fn, args))
        return await future

    def close(self) -> None:
        """Finish queued calls, then close every thread's connection and stop.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join(THREAD_JOIN_TIMEOUT_S)

    def _work(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                self._run(*job)
                # Not held while the thread waits for its next job: the call's arguments
                # (a request and everything it refers to, a batch) go as soon as it is done.
                job = None
        finally:
            connections.close_all()

    def _run(self, future, fn: Callable[..., Any], args: tuple) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            if self._hot_path:
                use_prepared_statements(self._hot_path)
            result = fn(*args)
        except BaseException as exc:
            _drop_broken_connection()
            future.set_exception(exc)
        else:
            future.set_result(result)


class _Answer:
    """The side of an asyncio future a pool thread holds: the two calls of a
    ``concurrent.futures.Future`` the worker makes, answered through the loop's inbox."""

    __slots__ = ("future", "inbox")

    def __init__(self, future: asyncio.Future, inbox: loop_inbox.LoopInbox) -> None:
        self.future = future
        self.inbox = inbox

    def set_running_or_notify_cancel(self) -> bool:
        # Read from a pool thread: at worst a cancel that lands right now runs the call
        # anyway, and its answer is dropped (as a call cancelled while running).
        return not self.future.cancelled()

    def set_result(self, result: Any) -> None:
        self.inbox.post(loop_inbox.resolve, self.future, result)

    def set_exception(self, exc: BaseException) -> None:
        self.inbox.post(loop_inbox.reject, self.future, exc)
