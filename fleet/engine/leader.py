"""Per-tick leader election: run a job only in the process that wins a PostgreSQL advisory lock.

Loops that must run once cluster-wide (recovery sweeps, autoscaler, reconciler)
call :func:`run_as_leader` on every tick.  The locks are taken on one dedicated
autocommit connection per process, separate from Django's, so a session-level
advisory lock can never leak into (or be released by) ordinary ORM work.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import psycopg
from django.db import connections

log = logging.getLogger(__name__)

# A session's advisory locks die with the session, and PostgreSQL ends a session when its
# socket closes.  A leader killed on its host closes it at once (the kernel sends the FIN);
# a leader whose host vanishes (power, network) leaves a half-open socket that PostgreSQL
# only notices through TCP keepalives (2 hours by default).  These bound that to
# IDLE + INTERVAL × COUNT = 25 s, under one default control tick (30 s): a takeover within a
# tick either way.  Set per session (SET, not a startup option, so PgBouncer in session mode
# passes them); ignored on a Unix socket, where a dead peer is seen at once anyway.
KEEPALIVE_IDLE_S = 10
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_COUNT = 3
_KEEPALIVES = (
    ("tcp_keepalives_idle", KEEPALIVE_IDLE_S),
    ("tcp_keepalives_interval", KEEPALIVE_INTERVAL_S),
    ("tcp_keepalives_count", KEEPALIVE_COUNT),
    # Unacknowledged data (a lock answer sent into the void) gives up as fast.
    ("tcp_user_timeout", (KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_COUNT) * 1000),
)

_shared: psycopg.Connection | None = None  # the session of every per-tick leader lock
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
    conn = psycopg.connect(**params, autocommit=True)
    _detect_dead_peer(conn)
    return conn


def _detect_dead_peer(conn: psycopg.Connection) -> None:
    """Server-side keepalives on a lock-holding session (see KEEPALIVE_IDLE_S)."""
    for name, value in _KEEPALIVES:
        try:
            conn.execute(f"SET {name} = {int(value)}")
        except psycopg.Error as exc:  # an old server without tcp_user_timeout, a pooler
            log.debug("leader connection: cannot set %s: %s", name, exc)


def lock_connection() -> psycopg.Connection:
    """The one session this process takes every per-tick leader lock on (opened, or opened
    again after it broke).  Advisory locks of different ids on one session are
    independent, and a job's own work runs on Django's connections, so one session serves
    every leader-only job: one PostgreSQL connection per replica instead of one per job
    (docs/scaling.md counts them)."""
    global _shared
    with _registry_lock:
        if _shared is None or _shared.closed or _shared.broken:
            _shared = dedicated_connection()
        return _shared


def run_as_leader(lock_id: int, func: Callable[[], object]) -> bool:
    """Run ``func`` if this process wins ``pg_try_advisory_lock(lock_id)`` for this tick.

    Returns whether it ran.  The lock is released right after, so leadership is
    decided again on the next tick (a dead leader is replaced within one interval).
    """
    with _registry_lock:
        guard = _guards.setdefault(lock_id, threading.Lock())
    with guard:
        try:
            conn = lock_connection()
            won = conn.execute("SELECT pg_try_advisory_lock(%s)", [lock_id]).fetchone()[0]
        except psycopg.Error as exc:
            # The database is away: nobody can lead this tick; a fresh connection next time.
            log.warning("leader election for lock %s failed: %s", lock_id, exc)
            _drop_if_broken()
            return False
        if not won:
            return False
        try:
            func()
        finally:
            try:
                conn.execute("SELECT pg_advisory_unlock(%s)", [lock_id])
            except psycopg.Error:
                _drop_if_broken()  # a lost session has released the lock anyway
        return True


def _drop_if_broken() -> None:
    """Close the shared session only once it is unusable: closing a healthy one would
    release the locks other jobs of this process hold on it right now."""
    global _shared
    with _registry_lock:
        conn = _shared
        if conn is not None and (conn.closed or conn.broken):
            _shared = None
            _close(conn)


def _close(conn: psycopg.Connection) -> None:
    try:
        conn.close()
    except psycopg.Error:
        pass


def close_all() -> None:
    """Close the leader locks' session (on shutdown): every lock it held is released."""
    global _shared
    with _registry_lock:
        conn, _shared = _shared, None
    if conn is not None:
        _close(conn)
