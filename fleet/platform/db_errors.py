"""Telling a database that cannot be reached from one that refused a statement.

When PostgreSQL is down, restarting or out of connections, every periodic job and every
shutdown step fails the same way, once per tick: a full traceback each time buries the one
line an operator needs.  Callers use :func:`database_unavailable` to log such a failure as
one line (docs/operations.md, "When PostgreSQL is gone") and keep the traceback for errors
that are bugs or contention (a deadlock, a statement timeout, a constraint violation).
"""

from __future__ import annotations

import psycopg

# SQLSTATE classes and codes that mean "no usable connection", not "this statement failed":
# 08 connection exceptions; 57P01 admin shutdown, 57P02 crash shutdown, 57P03 cannot
# connect now (starting up or in recovery).  53300 too many connections.
UNAVAILABLE_CLASSES = ("08",)
UNAVAILABLE_CODES = frozenset({"57P01", "57P02", "57P03", "53300"})


def _causes(exc: BaseException):
    """``exc`` and what it was raised from (Django wraps psycopg's errors), without loops."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def database_unavailable(exc: BaseException) -> bool:
    """True when ``exc`` (or what it wraps) says the database could not be reached.

    psycopg raises ``OperationalError`` without a SQLSTATE when the socket fails or the
    server hangs up; the pool's ``PoolTimeout`` and ``PoolClosed`` are such errors too.
    An error the server answered with a SQLSTATE counts only in the classes above."""
    for error in _causes(exc):
        if isinstance(error, psycopg.OperationalError):
            state = error.sqlstate
            return (
                state is None
                or state.startswith(UNAVAILABLE_CLASSES)
                or (state in UNAVAILABLE_CODES)
            )
    return False


def one_line(exc: BaseException) -> str:
    """The error's first line (libpq's messages carry a second, indented hint line)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
