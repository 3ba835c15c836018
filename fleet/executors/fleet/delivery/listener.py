"""The dedicated LISTEN connection: notifications in, callbacks out.

One autocommit psycopg connection per server process LISTENs on the
delivery channels and does nothing else; each notification only calls a
cheap callback (set an asyncio.Event, resolve a future).  A dropped
connection is re-opened with backoff, and ``on_reconnect`` tells every
subscriber that notifications may have been missed, so they re-check the
database: a lost notification costs latency, never work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import psycopg
from psycopg import sql

from fleet.executors.fleet.delivery.pg import connect_async

log = logging.getLogger(__name__)

RECONNECT_MIN_S = 0.2
RECONNECT_MAX_S = 5.0


class NotificationListener:
    def __init__(
        self,
        handlers: dict[str, Callable[[str], None]],
        on_reconnect: Callable[[], None] | None = None,
    ) -> None:
        self._handlers = dict(handlers)
        self._on_reconnect = on_reconnect
        self._task: asyncio.Task | None = None
        self._conn: psycopg.AsyncConnection | None = None
        self.listening = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="delivery-listener")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        await self._close()

    async def _close(self) -> None:
        conn, self._conn = self._conn, None
        self.listening.clear()
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def _run(self) -> None:
        delay = RECONNECT_MIN_S
        while True:
            try:
                self._conn = await connect_async("cloacina-listen")
                for channel in self._handlers:
                    await self._conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                self.listening.set()
                delay = RECONNECT_MIN_S
                if self._on_reconnect is not None:
                    self._on_reconnect()
                async for note in self._conn.notifies():
                    handler = self._handlers.get(note.channel)
                    if handler is not None:
                        try:
                            handler(note.payload)
                        except Exception:
                            log.exception("notification handler for %s failed", note.channel)
            except asyncio.CancelledError:
                raise
            except (psycopg.Error, OSError) as exc:
                log.warning("LISTEN connection lost (%s); reconnecting in %.1fs", exc, delay)
            await self._close()
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX_S)
