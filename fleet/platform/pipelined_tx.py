"""A transaction whose BEGIN travels with its first statement and whose COMMIT with its
last: psycopg's pipeline mode, for the hot paths where every round trip is latency.

Under :func:`django.db.transaction.atomic` psycopg sends ``BEGIN`` before the first
statement and waits for its answer (even in pipeline mode), and ``COMMIT`` is a round
trip of its own: two of the placement's round trips carried no work.
:class:`pipelined_atomic` keeps psycopg in autocommit and sends ``BEGIN`` and ``COMMIT``
itself, each in pipeline mode with the statements around it:

* on entry ``BEGIN`` is queued; the first statement joins it, and :meth:`~pipelined_atomic.sync`
  sends both with a sync and reads their answers — one round trip — and leaves pipeline
  mode;
* from there on statements run one by one as usual, so everything Django and the ORM
  expect holds (``cursor.rowcount`` above all, which pipeline mode only knows once the
  result is read);
* :meth:`~pipelined_atomic.pipeline_tail` enters pipeline mode again for the last
  statements: they are queued, sent with ``COMMIT`` and the sync on exit, and their rows
  are read after the block (one round trip).  Only statements whose results nobody
  needs before the commit belong there.

Inside it Django sees an ordinary outermost ``atomic`` block: a nested
``transaction.atomic()`` is a savepoint, ``transaction.on_commit`` hooks run after the
commit (never on a rollback), ``transaction.set_rollback(True)`` rolls the transaction
back.  An exception rolls it back and propagates; database errors are Django's.  Used
where it is not the outermost block (or under manual transaction management), it is a
plain ``transaction.atomic()`` and :meth:`sync` and :meth:`pipeline_tail` do nothing.
"""

from __future__ import annotations

import contextlib
import logging
from types import TracebackType

import psycopg
from django.db import DatabaseError, connection, transaction

log = logging.getLogger(__name__)


class pipelined_atomic:  # noqa: N801 - used like transaction.atomic
    """``with pipelined_atomic() as tx: ...`` — see the module docstring."""

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
        self._enter_pipeline()
        try:
            self._raw.execute(b"BEGIN", prepare=False)  # queued: sent with the first statement
        except BaseException:
            self._leave_pipeline(None, None, None)
            raise
        # Django's view of an outermost atomic block (Atomic.__enter__), without its BEGIN.
        connection.autocommit = False
        connection.in_atomic_block = True
        connection.commit_on_exit = True
        connection.needs_rollback = False
        return self

    def sync(self) -> None:
        """Send what is queued with a sync, read the answers, and leave pipeline mode."""
        if self._pipeline is not None:
            with connection.wrap_database_errors:
                self._leave_pipeline(None, None, None)

    def pipeline_tail(self) -> None:
        """Queue the statements that follow, to be sent with the COMMIT (module docstring)."""
        if self._plain is None and self._pipeline is None:
            self._enter_pipeline()

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
                try:
                    if commit:
                        self._raw.execute(b"COMMIT", prepare=False)
                except BaseException as error:
                    # A queued statement's error may surface as soon as the COMMIT is
                    # queued (psycopg reads what has arrived): leave pipeline mode anyway.
                    self._leave_pipeline(type(error), error, error.__traceback__)
                    raise
                # The sync: the COMMIT's answer, and the error of any statement still unread.
                self._leave_pipeline(exc_type, exc, tb)
        except BaseException:
            self._finish(committed=False)
            raise
        self._finish(committed=commit)

    def _enter_pipeline(self) -> None:
        pipeline = self._raw.pipeline()
        pipeline.__enter__()
        self._pipeline = pipeline

    def _leave_pipeline(self, exc_type, exc, tb) -> None:
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is not None:
            pipeline.__exit__(exc_type, exc, tb)

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
