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


def test_a_pg_hba_written_when_this_module_lived_elsewhere_still_counts_as_configured():
    """Data directories keep the pg_hba.conf they were first given; its comment names the
    module's path at that time.  Only the rules decide, so moving the module never sends a
    configured directory down the "still trusting" path (which would fail to connect)."""
    older = embedded_db.HBA.replace("(fleet/platform/embedded_db.py)", "(somewhere/else.py)")
    assert older != embedded_db.HBA
    assert embedded_db.hba_rules(older) == embedded_db.hba_rules(embedded_db.HBA)
    trusting = "local all all trust\nhost all all 127.0.0.1/32 trust\n"
    assert embedded_db.hba_rules(trusting) != embedded_db.hba_rules(embedded_db.HBA)


def test_redacted_url_hides_the_password_and_keeps_where_it_points():
    url = embedded_db.with_password(
        "postgresql://postgres:@/cloacina_bench?host=/tmp/x/pgdata", "s3cr/t@x"
    )
    shown = embedded_db.redacted_url(url)
    assert "s3cr" not in shown and "%2F" not in shown
    assert shown == "postgresql://postgres:***@/cloacina_bench?host=/tmp/x/pgdata"
    tcp = "postgres://app:hunter2@db.example:5433/prod?sslmode=require&password=hunter3"
    assert embedded_db.redacted_url(tcp) == (
        "postgres://app:***@db.example:5433/prod?sslmode=require&password=***"
    )


def test_redacted_url_leaves_a_url_without_a_password_alone():
    assert embedded_db.redacted_url("postgresql://u@localhost/db") == "postgresql://u@localhost/db"
    assert (
        embedded_db.redacted_url("postgresql://nowhere.invalid/x")
        == "postgresql://nowhere.invalid/x"
    )


def test_redacted_url_hides_whatever_it_cannot_parse():
    assert embedded_db.redacted_url("postgresql://u:pw@host:notaport/db") == "***"
    assert embedded_db.redacted_url("u:pw@host/db") == "***"
    assert embedded_db.redacted_url("postgresql:///db?host=/s&password=pw") == (
        "postgresql:///db?host=/s&password=***"
    )
