"""Per-tick leader election: run a job only in the process that wins a PostgreSQL advisory lock.

Loops that must run once cluster-wide (recovery sweeps, autoscaler, reconciler)
call :func:`run_as_leader` on every tick.  Each lock id gets its own dedicated
autocommit connection, separate from Django's, so a session-level advisory lock
can never leak into (or be released by) ordinary ORM work on the same thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import psycopg
from django.db import connections

log = logging.getLogger(__name__)

_connections: dict[int, psycopg.Connection] = {}
_guards: dict[int, threading.Lock] = {}
_registry_lock = threading.Lock()


def dedicated_connection(alias: str = "default") -> psycopg.Connection:
    """An autocommit connection of its own, outside Django's: a session advisory lock
    lives as long as its connection, so it must not be one Django may close or share."""
    params = connections[alias].get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    params.pop("prepare_threshold", None)
    params.pop("server_side_binding", None)
    return psycopg.connect(**params, autocommit=True)


def _connection_for(lock_id: int) -> psycopg.Connection:
    conn = _connections.get(lock_id)
    if conn is None or conn.closed or conn.broken:
        conn = dedicated_connection()
        _connections[lock_id] = conn
    return conn


def run_as_leader(lock_id: int, func: Callable[[], object]) -> bool:
    """Run ``func`` if this process wins ``pg_try_advisory_lock(lock_id)`` for this tick.

    Returns whether it ran.  The lock is released right after, so leadership is
    decided again on the next tick (a dead leader is replaced within one interval).
    """
    with _registry_lock:
        guard = _guards.setdefault(lock_id, threading.Lock())
    with guard:
        try:
            conn = _connection_for(lock_id)
            won = conn.execute("SELECT pg_try_advisory_lock(%s)", [lock_id]).fetchone()[0]
        except psycopg.Error as exc:
            # The database is away: nobody can lead this tick; try a fresh connection next time.
            log.warning("leader election for lock %s failed: %s", lock_id, exc)
            _drop(lock_id)
            return False
        if not won:
            return False
        try:
            func()
        finally:
            try:
                conn.execute("SELECT pg_advisory_unlock(%s)", [lock_id])
            except psycopg.Error:
                _drop(lock_id)  # closing the session releases the lock anyway
        return True


def _drop(lock_id: int) -> None:
    conn = _connections.pop(lock_id, None)
    if conn is not None:
        try:
            conn.close()
        except psycopg.Error:
            pass


def close_all() -> None:
    """Close every dedicated leader connection (on shutdown)."""
    with _registry_lock:
        for lock_id in list(_connections):
            _drop(lock_id)
