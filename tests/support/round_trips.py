"""Counting a connection's round trips to PostgreSQL from libpq's protocol trace."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import psycopg
from django.db import connection


class RoundTrips:
    """libpq's protocol trace of this thread's connection: each run of messages the client
    sent before it read the server's answers is one round trip."""

    def __init__(self, pgconn: psycopg.pq.abc.PGconn | None = None) -> None:
        # pgconn: another connection's (an async one of the event loop); default Django's.
        self._pgconn = pgconn
        fd, name = tempfile.mkstemp(prefix="pqtrace-")
        os.close(fd)
        self.path = Path(name)
        self._file = self.path.open("w")

    def __enter__(self) -> RoundTrips:
        if self._pgconn is None:
            connection.ensure_connection()
            self._pgconn = connection.connection.pgconn
        pgconn = self._pgconn
        pgconn.trace(self._file.fileno())
        pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
        return self

    def __exit__(self, *exc) -> None:
        self._pgconn.untrace()
        self._file.close()
        self.lines = [line.split("\t") for line in self.path.read_text().splitlines()]
        self.path.unlink()

    def trips(self) -> list[list[str]]:
        """The messages each round trip sent (message names, e.g. Parse, Execute, Sync)."""
        trips: list[list[str]] = []
        sending = False
        for fields in self.lines:
            if len(fields) < 3 or fields[0] not in ("F", "B"):
                continue  # a message's text spilling over a line break
            direction, message = fields[0], fields[2]
            if direction == "F":
                if not sending:
                    trips.append([])
                    sending = True
                trips[-1].append(message)
            else:
                sending = False
        return trips
