"""Sticky leadership for the control plane: one server drives the fleet until it dies.

``serve`` already gates leader-only jobs with a per-tick advisory lock
(:func:`fleet.engine.leader.run_as_leader`), which is released after each
tick, so consecutive ticks may land on different servers.  That is fine for
idempotent sweeps but not for an actuator with local state: two servers taking
turns with the process actuator would each start their own children.  So the
control tick also holds a second, session-level advisory lock on a dedicated
connection *across* ticks.  It is released only when this process stops or
its connection dies (PostgreSQL drops a dead session's locks at once), and
the next server to tick takes over.
"""

from __future__ import annotations

import logging
import threading

import psycopg

from fleet.engine.leader import dedicated_connection
from fleet.platform.advisory_locks import lock_id_for

log = logging.getLogger(__name__)

LEADER_LOCK_ID = lock_id_for("fleet_control_leader")


class StickyLeadership:
    def __init__(self, lock_id: int = LEADER_LOCK_ID) -> None:
        self.lock_id = lock_id
        self._conn: psycopg.Connection | None = None
        self._held = False
        self._guard = threading.Lock()

    @property
    def held(self) -> bool:
        return self._held

    def hold(self) -> bool:
        """Keep (or try to win) the lock; True while this process is the leader."""
        with self._guard:
            try:
                if self._held:
                    self._conn.execute("SELECT 1")  # a dead session has lost the lock
                    return True
                if self._conn is None or self._conn.closed or self._conn.broken:
                    self._conn = dedicated_connection()
                won = self._conn.execute(
                    "SELECT pg_try_advisory_lock(%s)", [self.lock_id]
                ).fetchone()[0]
                self._held = bool(won)
                return self._held
            except psycopg.Error as exc:
                log.warning("fleet control: leadership connection failed: %s", exc)
                self._close()
                return False

    def release(self) -> None:
        with self._guard:
            if self._held and self._conn is not None and not self._conn.closed:
                try:
                    self._conn.execute("SELECT pg_advisory_unlock(%s)", [self.lock_id])
                except psycopg.Error:
                    pass
            self._close()

    def _close(self) -> None:
        self._held = False
        if self._conn is not None:
            try:
                self._conn.close()
            except psycopg.Error:
                pass
        self._conn = None
