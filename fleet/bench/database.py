"""The benchmark's own database, ``cloacina_bench``, on the same PostgreSQL server.

The benchmark flushes it on every run, so it must never be the real one:
:func:`use_bench_database` creates it if needed, points this process's
default connection at it, migrates it and empties it.
"""

from __future__ import annotations

import os
from urllib.parse import quote

from django.conf import settings
from django.core.management import call_command
from django.db import connection, connections

BENCH_DB = "cloacina_bench"


def database_url(settings_dict: dict) -> str:
    """A postgresql:// URL for a Django DATABASES entry (Unix-socket hosts included)."""
    user = quote(settings_dict.get("USER") or "", safe="")
    password = quote(settings_dict.get("PASSWORD") or "", safe="")
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    host = settings_dict.get("HOST") or ""
    name = quote(settings_dict["NAME"], safe="")
    if host.startswith("/"):
        return f"postgresql://{auth}/{name}?host={quote(host, safe='/')}"
    port = f":{settings_dict['PORT']}" if settings_dict.get("PORT") else ""
    return f"postgresql://{auth}{host}{port}/{name}"


def use_bench_database(name: str = BENCH_DB) -> str:
    """Switch this process to database ``name`` (created, migrated, flushed); return its URL."""
    if connection.settings_dict["NAME"] != name:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name])
            if cursor.fetchone() is None:
                cursor.execute(f'CREATE DATABASE "{name}"')
        connections.close_all()
        connection.close_pool()  # a pool keeps connecting to the database it was made for
        # The same switch Django's test runner makes for its test database.
        settings.DATABASES["default"]["NAME"] = name
        connection.settings_dict["NAME"] = name
    url = database_url(connection.settings_dict)
    os.environ["DATABASE_URL"] = url  # child processes (the server under test) use it too
    call_command("migrate", interactive=False, verbosity=0)
    call_command("flush", interactive=False, verbosity=0)
    return url


def deadlocks() -> int:
    """Deadlocks PostgreSQL detected in this database so far (``pg_stat_database``), read
    afresh: a new snapshot of the statistics, not the one this transaction saw first."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        return int(cursor.fetchone()[0])


def flush_statistics() -> None:
    """Make this backend add its pending statistics (a deadlock it was the victim of) to
    the shared counters now: a pooled connection's backend does not exit, and an idle one
    flushes only seconds later.  The flush runs when the backend goes idle after the first
    statement, so it has happened once the second returns."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT 1")
