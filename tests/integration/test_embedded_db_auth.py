"""The embedded PostgreSQL asks for a password: a data directory pgserver initialised with
trust authentication (as every Cloacina before this one left it) is migrated at boot.

Here: the integration tests (database, in-process ASGI, fakes); the rest are in tests/unit/test_embedded_db_auth.py.
"""

from __future__ import annotations

import stat
from pathlib import Path

import psycopg
import pytest

from fleet.platform import embedded_db


@pytest.fixture
def legacy_home(tmp_path, monkeypatch):
    """A CLOACINA_HOME whose data directory trusts every local connection, running."""
    import pgserver

    monkeypatch.setattr(embedded_db, "_server", embedded_db._server)  # restored afterwards
    home = tmp_path / "home"
    home.mkdir()
    server = pgserver.get_server(home / "pgdata", cleanup_mode="stop")
    yield home, server.get_uri()
    server.cleanup()


def refused_without_password(url: str) -> bool:
    try:
        psycopg.connect(url, passfile="/dev/null", connect_timeout=5).close()
    except psycopg.OperationalError:
        return True
    return False


def test_a_trusting_data_directory_gets_a_password_at_boot(legacy_home):
    home, trust_url = legacy_home
    assert not refused_without_password(trust_url)  # the hole: anyone on the socket is root

    url = embedded_db.start_embedded(home)

    password = (home / "pg_password").read_text()
    assert stat.S_IMODE((home / "pg_password").stat().st_mode) == 0o600
    assert embedded_db.database_settings(url)["PASSWORD"] == password
    assert refused_without_password(trust_url)
    assert refused_without_password(embedded_db.with_password(trust_url, "guessed"))
    with psycopg.connect(url) as conn:
        user, secret = conn.execute(
            "SELECT current_user, rolpassword FROM pg_authid WHERE rolname = current_user"
        ).fetchone()
    assert user == "postgres" and secret.startswith("SCRAM-SHA-256$")
    pgdata = home / "pgdata"
    assert (pgdata / "pg_hba.conf").read_text() == embedded_db.HBA
    assert "trust" not in "".join(
        line for line in embedded_db.HBA.splitlines() if not line.startswith("#")
    )
    socket_dir = Path(embedded_db.database_settings(url)["HOST"])
    assert stat.S_IMODE(socket_dir.stat().st_mode) == 0o700

    # Another process booting on the same home (a second serve): same password, no migration.
    assert embedded_db.start_embedded(home) == url
    with psycopg.connect(embedded_db.url_for_database(url, "postgres")) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_a_password_file_that_does_not_match_the_server_stops_the_boot_with_what_to_do(
    legacy_home,
):
    home, _trust_url = legacy_home
    embedded_db.start_embedded(home)
    (home / "pg_password").write_text("not-the-one")
    with pytest.raises(embedded_db.EmbeddedDatabaseError, match="restore that file"):
        embedded_db.start_embedded(home)
