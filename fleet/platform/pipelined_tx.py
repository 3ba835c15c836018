"""A transaction whose BEGIN travels with its first statement and whose COMMIT with its
last: psycopg's pipeline mode, for the hot paths where every round trip is latency.

Under :func:`django.db.transaction.atomic` psycopg sends ``BEGIN`` before the first
statement and waits for its answer (even in pipeline mode), and ``COMMIT`` is a round
trip of its own: two of the placement's round trips carried no work.
:class:`pipelined_atomic` keeps psycopg in autocommit and queues ``BEGIN`` and
``COMMIT`` itself, in pipeline mode, so they go out with the statements around them;
only reading a result (``fetchone``/``fetchall``) waits for the server.

Inside it, Django sees an ordinary outermost ``atomic`` block: a nested
``transaction.atomic()`` is a savepoint, ``transaction.on_commit`` hooks run after the
commit (never on a rollback), ``transaction.set_rollback(True)`` rolls the transaction
back.  An exception rolls it back and propagates.  A database error inside a nested
block cannot be recovered at the savepoint (pipeline mode skips every statement after
an error until its next sync), so such an error rolls back the whole transaction;
callers that retry do so around the whole block.  Used where it is not the outermost
block (or under manual transaction management), it is a plain ``transaction.atomic()``.
"""

from __future__ import annotations

import contextlib
import logging
from types import TracebackType

import psycopg
from django.db import DatabaseError, connection, transaction

log = logging.getLogger(__name__)


class pipelined_atomic:  # noqa: N801 - used like transaction.atomic
    """``with pipelined_atomic(): ...`` — see the module docstring."""

    def __init__(self) -> None:
        self._plain: transaction.Atomic | None = None
        self._pipeline: contextlib.AbstractContextManager | None = None
        self._raw: psycopg.Connection | None = None

    def __enter__(self) -> pipelined_atomic:
        if connection.in_atomic_block or not connection.get_autocommit():
            self._plain = transaction.atomic()
            self._plain.__enter__()
            return self
        connection.ensure_connection()
        self._raw = connection.connection
        self._pipeline = self._raw.pipeline()
        self._pipeline.__enter__()
        try:
            self._raw.execute(b"BEGIN", prepare=False)  # queued: sent with the first statement
        except BaseException:
            self._pipeline.__exit__(None, None, None)
            raise
        # Django's view of an outermost atomic block (Atomic.__enter__), without its BEGIN.
        connection.autocommit = False
        connection.in_atomic_block = True
        connection.commit_on_exit = True
        connection.needs_rollback = False
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._plain is not None:
            self._plain.__exit__(exc_type, exc, tb)
            return
        commit = exc_type is None and not connection.needs_rollback
        try:
            # Errors as Django's (DatabaseError, IntegrityError, …), like a cursor's.
            with connection.wrap_database_errors:
                if commit:
                    self._raw.execute(b"COMMIT", prepare=False)
                # The sync: the COMMIT's answer, and the error of any statement still unread.
                self._pipeline.__exit__(exc_type, exc, tb)
        except BaseException:
            commit = False
            self._finish(commit)
            raise
        self._finish(commit)

    def _finish(self, committed: bool) -> None:
        """Django's flags back to autocommit, and the hooks run (committed) or dropped."""
        connection.in_atomic_block = False
        connection.autocommit = True
        connection.needs_rollback = False
        connection.savepoint_ids = []
        connection.atomic_blocks = []
        if committed:
            connection.run_and_clear_commit_hooks()
            return
        connection.run_on_commit = []
        self._roll_back()

    def _roll_back(self) -> None:
        raw = self._raw
        if raw is None or raw.closed:
            return
        try:
            if raw.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                raw.execute(b"ROLLBACK", prepare=False)
        except (psycopg.Error, DatabaseError, OSError):
            # The connection is broken: a fresh one on the next use.
            log.debug("rollback failed; closing the connection", exc_info=True)
            connection.close()
