"""The server's PostgreSQL connection pool and the hot-path threads' session switch."""

from __future__ import annotations

import json
import uuid

import pytest
from django.conf import settings
from django.db import connection
from django.db.backends.postgresql.base import Cursor, ServerBindingCursor
from psycopg.adapt import PyFormat
from psycopg.types.array import ListBinaryDumper, ListDumper

from fleet.engine import db_threads
from fleet.engine.db_threads import DbThreadPool
from fleet.platform import db_pool
from fleet.platform.config import ConfigError
from fleet.platform.embedded_db import database_settings

pytestmark = pytest.mark.django_db(transaction=True)


def session() -> tuple[type, str, int | None]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('application_name')")
        (name,) = cursor.fetchone()
    raw = connection.connection
    return raw.cursor_factory, name, raw.prepare_threshold


def backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


def test_the_pool_is_sized_from_the_workers_unless_configured():
    assert db_pool.pool_size(0, 4) == 8 + db_pool.DELIVERY_THREADS + db_pool.BORROWERS
    assert db_pool.pool_size(0, 16) == 32 + db_pool.DELIVERY_THREADS + db_pool.BORROWERS
    assert db_pool.pool_size(60, 16) == 60
    with pytest.raises(ConfigError, match="CLOACINA_DB_POOL_MAX must be at least 48 with 16"):
        db_pool.pool_size(7, 16)
    assert db_pool.pool_options(1)["min_size"] == 1


def test_the_database_settings_carry_the_pool_and_its_reset():
    entry = database_settings("postgresql://u@localhost/db", pool=db_pool.pool_options(10))
    assert entry["OPTIONS"]["pool"]["max_size"] == 10
    assert entry["OPTIONS"]["pool"]["reset"] is db_pool.reset_session
    assert entry["CONN_MAX_AGE"] == 0 and entry["CONN_HEALTH_CHECKS"] is True
    plain = database_settings("postgresql://u@localhost/db?sslmode=require")
    assert plain["OPTIONS"] == {"sslmode": "require"}
    assert plain["CONN_HEALTH_CHECKS"] is False
    assert "pool" in settings.DATABASES["default"]["OPTIONS"]  # the server's own settings


def test_a_closed_connection_goes_back_to_the_pool_and_is_reused():
    connection.ensure_connection()
    connection.close()
    pool = connection.pool
    pool.wait(10)  # the pool's first min_size connections are opened in the background
    opened_before = pool.get_stats().get("connections_num", 0)
    pids = set()
    for _ in range(8):
        connection.ensure_connection()
        pids.add(backend_pid())
        connection.close()
    # Without a pool each reconnection forks a new backend; with it, all eight borrow
    # connections the pool already had (it hands its idle ones out in turn).
    assert pool.get_stats().get("connections_num", 0) == opened_before
    assert len(pids) <= pool.get_stats()["pool_size"]


def test_hot_path_threads_prepare_statements_under_their_own_name():
    pool = DbThreadPool(1, "pool-test", hot_path="cloacina-pool-test")
    try:
        factory, name, threshold = pool.submit(session).result(10)
    finally:
        pool.close()
    assert factory is ServerBindingCursor
    assert name == "cloacina-pool-test"
    assert threshold is not None
    plain = DbThreadPool(1, "pool-test-plain")
    try:
        factory, name, threshold = plain.submit(session).result(10)
    finally:
        plain.close()
    assert factory is Cursor and name != "cloacina-pool-test" and threshold is None


PLANNED = "SELECT count(*) FROM fleet_tenant WHERE id = ANY(%s) AND name <> %s"


def plans_of_a_repeated_statement(times: int) -> tuple[str, int, int]:
    """On this thread's connection: run one statement ``times`` times with new parameters,
    then the session's plan_cache_mode and the statement's generic and custom plans."""
    with connection.cursor() as cursor:
        for i in range(times):
            cursor.execute(PLANNED, [[i, i + 1], f"tenant-{i}"])
            cursor.fetchone()
        cursor.execute("SELECT current_setting('plan_cache_mode')")
        (mode,) = cursor.fetchone()
        cursor.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
            "WHERE statement LIKE 'SELECT count(*) FROM fleet_tenant WHERE id = ANY%%'"
        )
        generic, custom = cursor.fetchone()
    return mode, generic, custom


def test_hot_path_threads_plan_a_prepared_statement_generically_from_its_first_run():
    # PostgreSQL's default plans a prepared statement's first five executions for their
    # parameters (five plannings per statement and thread on a fresh server) before it
    # takes the generic plan; a hot-path connection takes the generic plan at once.
    pool = DbThreadPool(1, "pool-test", hot_path="cloacina-pool-test")
    try:
        mode, generic, custom = pool.submit(plans_of_a_repeated_statement, 9).result(10)
    finally:
        pool.close()
    prepared_runs = 9 - db_threads.PREPARE_THRESHOLD
    assert mode == "force_generic_plan"
    assert (generic, custom) == (prepared_runs, 0)


def test_reset_gives_a_hot_path_connection_back_with_djangos_defaults():
    raw = connection.pool.getconn()
    try:
        raw.cursor_factory = ServerBindingCursor
        raw.prepare_threshold = 2
        db_pool.binary_lists(raw, True)
        raw.execute("SET application_name = 'cloacina-pool-test'")
        raw.execute("SET plan_cache_mode = force_generic_plan")
        db_pool.reset_session(raw)
        assert raw.cursor_factory is Cursor and raw.prepare_threshold is None
        assert raw.adapters.get_dumper(list, PyFormat.AUTO) is ListDumper
        assert raw.execute("SHOW application_name").fetchone()[0] != "cloacina-pool-test"
        assert raw.execute("SHOW plan_cache_mode").fetchone()[0] == "auto"
    finally:
        connection.pool.putconn(raw)


def list_round_trip(payloads: list[str], ids: list[uuid.UUID]) -> tuple[type, list, list]:
    """On this thread's connection: the list dumper ``%s`` uses, and what the database makes
    of a list of JSON texts cast to jsonb[] and of a list of uuids compared with a uuid."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT x::text FROM unnest(%s::jsonb[]) WITH ORDINALITY AS u(x, i) ORDER BY i",
            [payloads],
        )
        back = [json.loads(text) for (text,) in cursor.fetchall()]
        cursor.execute("SELECT u FROM unnest(%s::uuid[]) AS u WHERE u = ANY(%s)", [ids, ids[:1]])
        found = [u for (u,) in cursor.fetchall()]
    return connection.connection.adapters.get_dumper(list, PyFormat.AUTO), back, found


def test_hot_path_threads_send_lists_as_binary_arrays_and_they_arrive_intact():
    # Elements the text array format must quote or escape: quotes, backslashes, braces,
    # commas, white space, the word NULL, an empty string, non-ASCII text.
    values = [
        {"context_json": json.dumps({"a": 'x"y\\z', "b": "{1,2}"}), "n": 1},
        {"s": "NULL", "t": "", "u": " spaced\ttab\n", "v": "grüße ✓", "w": None},
        "NULL",
        [],
    ]
    payloads = [json.dumps(value) for value in values]
    ids = [uuid.uuid4(), uuid.uuid4()]
    hot = DbThreadPool(1, "pool-test", hot_path="cloacina-pool-test")
    plain = DbThreadPool(1, "pool-test-plain")
    try:
        hot_dumper, hot_back, hot_found = hot.submit(list_round_trip, payloads, ids).result(10)
        plain_dumper, plain_back, plain_found = plain.submit(list_round_trip, payloads, ids).result(
            10
        )
    finally:
        hot.close()
        plain.close()
    assert hot_dumper is ListBinaryDumper and plain_dumper is ListDumper
    assert hot_back == plain_back == values
    assert hot_found == plain_found == ids[:1]


def test_reset_leaves_an_untouched_connection_alone():
    raw = connection.pool.getconn()
    try:
        raw.execute("SET application_name = 'someone-else'")
        db_pool.reset_session(raw)  # not a hot-path connection: no statement, nothing reset
        assert raw.execute("SHOW application_name").fetchone()[0] == "someone-else"
        raw.execute("RESET application_name")
    finally:
        connection.pool.putconn(raw)


def test_the_pool_is_on_metrics(client):
    connection.ensure_connection()
    connection.close()
    connection.pool.wait(10)
    text = client.get("/metrics").content.decode()
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("cloacina_db_pool_")
    }
    assert values["cloacina_db_pool_max"] == connection.pool.max_size
    assert values["cloacina_db_pool_connections"] >= db_pool.MIN_SIZE
    assert 0 <= values["cloacina_db_pool_idle"] <= values["cloacina_db_pool_connections"]
    assert values["cloacina_db_pool_waiting"] == 0
    assert values["cloacina_db_pool_connections_opened_total"] >= db_pool.MIN_SIZE
    assert "cloacina_db_pool_borrow_errors_total" in values


def test_the_pool_leaves_room_for_every_delivery_thread():
    from fleet.executors.fleet.delivery.db import POOL_THREADS

    assert db_pool.DELIVERY_THREADS == POOL_THREADS
