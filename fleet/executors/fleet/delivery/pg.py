"""Dedicated psycopg connections for the delivery loops, outside Django's ORM.

The relay, the LISTEN connection and the capacity probe each hold one async
autocommit connection of their own: LISTEN needs a session that nothing else
uses, and the relay's one-statement batches need no transaction management.
"""

from __future__ import annotations

import psycopg
from django.db import connections

from fleet.platform.db_pool import binary_lists


def connection_params(alias: str = "default") -> dict:
    """psycopg.connect() keywords for Django's database ``alias``."""
    params = connections[alias].get_connection_params()
    for key in ("cursor_factory", "context", "prepare_threshold", "server_side_binding"):
        params.pop(key, None)
    return params


async def connect_async(application_name: str, relaxed: bool = False) -> psycopg.AsyncConnection:
    """A new autocommit AsyncConnection, named so it is recognisable in pg_stat_activity.

    It sends list parameters as binary arrays (:func:`fleet.platform.db_pool.binary_lists`):
    the relay's outbox ids and the confirmations' agents and ids are per-task lists, and a
    text array escapes each element in Python.  A binary array is typed by its elements, so
    every statement on these connections casts the arrays it compares (``::bigint[]``).

    ``relaxed``: its commits do not wait for the WAL flush.  For bookkeeping whose loss in a
    database crash only costs a repeat (a packet pushed again, a beat or a receipt redone):
    the next synchronous commit — every outcome's — flushes it anyway.
    """
    params = connection_params()
    params.setdefault("application_name", application_name)
    conn = await psycopg.AsyncConnection.connect(**params, autocommit=True)
    binary_lists(conn, True)
    if relaxed:
        await conn.execute("SET synchronous_commit = off")
    return conn
