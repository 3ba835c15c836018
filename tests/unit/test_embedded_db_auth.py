"""The embedded PostgreSQL asks for a password: a data directory pgserver initialised with
trust authentication (as every Cloacina before this one left it) is migrated at boot.

Here: the unit tests (no database, socket or process); the rest are in tests/integration/test_embedded_db_auth.py.
"""

from __future__ import annotations

from fleet.platform import embedded_db


def test_with_password_keeps_the_socket_and_quotes_the_password():
    url = embedded_db.with_password("postgresql://postgres:@/postgres?host=/tmp/x/pgdata", "a/b@c")
    settings = embedded_db.database_settings(url)
    assert (settings["USER"], settings["PASSWORD"], settings["HOST"]) == (
        "postgres",
        "a/b@c",
        "/tmp/x/pgdata",
    )
