"""pipelined_atomic (fleet/platform/pipelined_tx.py): a transaction whose BEGIN goes out with
its first statement and whose COMMIT with the final sync, with atomic()'s semantics
(all or nothing, savepoints, on_commit after the commit only)."""

from __future__ import annotations

import psycopg
import pytest
from django.db import DatabaseError, connection, transaction

from fleet.platform.pipelined_tx import pipelined_atomic
from tests.support.round_trips import RoundTrips

pytestmark = pytest.mark.django_db(transaction=True)

TABLE = "pipelined_tx_probe"


@pytest.fixture
def probe_table():
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} (v int)")
        cursor.execute(f"TRUNCATE {TABLE}")
    yield
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {TABLE}")


def insert(value: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {TABLE} VALUES (%s)", [value])


def values() -> list[int]:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT v FROM {TABLE} ORDER BY v")
        return [row[0] for row in cursor.fetchall()]


def from_another_connection() -> list[int]:
    settings = connection.settings_dict
    with psycopg.connect(
        dbname=settings["NAME"], user=settings["USER"], password=settings["PASSWORD"] or None,
        host=settings["HOST"] or None, port=settings["PORT"] or None,
    ) as other:  # fmt: skip
        return [row[0] for row in other.execute(f"SELECT v FROM {TABLE} ORDER BY v")]


def assert_back_in_autocommit() -> None:
    assert connection.get_autocommit() and not connection.in_atomic_block
    raw = connection.connection
    assert raw.autocommit and raw.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_it_commits_everything_and_runs_on_commit_hooks_after_the_commit(probe_table):
    seen_at_hook: list[list[int]] = []
    with pipelined_atomic():
        insert(1)
        transaction.on_commit(lambda: seen_at_hook.append(from_another_connection()))
        insert(2)
        assert from_another_connection() == []  # not committed yet
        assert seen_at_hook == []
    assert seen_at_hook == [[1, 2]]
    assert values() == [1, 2]
    assert_back_in_autocommit()


def test_an_exception_rolls_everything_back_and_drops_the_hooks(probe_table):
    hooks: list[str] = []
    with pytest.raises(RuntimeError, match="boom"):
        with pipelined_atomic():
            insert(1)
            transaction.on_commit(lambda: hooks.append("ran"))
            raise RuntimeError("boom")
    assert values() == [] and hooks == []
    assert_back_in_autocommit()


def test_a_failing_first_statement_fails_at_the_sync_and_rolls_back(probe_table):
    with pytest.raises(DatabaseError):
        with pipelined_atomic() as tx:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1 / 0")
                tx.sync()
                cursor.fetchone()
    assert values() == []
    assert_back_in_autocommit()


def test_a_failing_statement_rolls_the_whole_transaction_back(probe_table):
    with pytest.raises(DatabaseError):
        with pipelined_atomic() as tx:
            insert(1)
            tx.sync()
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1 / 0")
                cursor.fetchone()
    assert values() == []
    assert_back_in_autocommit()
    insert(3)  # the connection is usable again
    assert values() == [3]


def test_a_failing_statement_left_unread_fails_the_commit(probe_table):
    with pytest.raises(DatabaseError):
        with pipelined_atomic() as tx:
            insert(1)
            tx.sync()
            tx.pipeline_tail()
            with connection.cursor() as cursor:
                cursor.execute("INSERT INTO pipelined_tx_probe VALUES (1 / 0)")  # never read
    assert values() == []
    assert_back_in_autocommit()


def test_nested_atomic_is_a_savepoint_and_set_rollback_undoes_only_it(probe_table):
    with pipelined_atomic():
        insert(1)
        with transaction.atomic():
            insert(2)
            transaction.set_rollback(True)
        insert(3)
    assert values() == [1, 3]
    assert_back_in_autocommit()


def test_set_rollback_on_the_block_rolls_back_without_an_error(probe_table):
    with pipelined_atomic():
        insert(1)
        transaction.set_rollback(True)
    assert values() == []
    assert_back_in_autocommit()


def test_inside_an_atomic_block_it_is_a_plain_savepoint(probe_table):
    with transaction.atomic():
        insert(1)
        with pipelined_atomic():
            insert(2)
        assert connection.in_atomic_block
    assert values() == [1, 2]


def test_begin_travels_with_the_first_statement_and_commit_with_the_tail(probe_table):
    with RoundTrips() as traced:
        with pipelined_atomic() as tx:
            insert(1)
            tx.sync()  # BEGIN and the first insert, answered together
            with connection.cursor() as cursor:
                cursor.execute(f"UPDATE {TABLE} SET v = 10 WHERE v = 1")
                assert cursor.rowcount == 1  # out of pipeline mode: the ORM's rowcount holds
            tx.pipeline_tail()
            tail = connection.cursor()  # read after the commit: left open
            tail.execute(f"INSERT INTO {TABLE} VALUES (2) RETURNING v")
        assert tail.fetchall() == [(2,)]
        tail.close()
    trips = traced.trips()
    # 1: BEGIN + the insert + sync; 2: the update; 3: the tail's insert, COMMIT and the sync.
    assert len(trips) == 3, trips
    assert trips[0].count("Execute") == 2 and "Sync" in trips[0]
    assert trips[1] == ["Query"]  # one statement alone (client-side binding: a simple query)
    assert trips[2].count("Execute") == 2 and "Sync" in trips[2]
    assert values() == [2, 10]
    assert_back_in_autocommit()


def test_an_orm_update_between_sync_and_tail_sees_its_row_count(probe_table, tenant):
    """Django's save(update_fields=…) checks the UPDATE's row count: it must be known."""
    from fleet.models import Tenant

    with pipelined_atomic() as tx:
        insert(1)
        tx.sync()
        tenant.name = "renamed"
        tenant.save(update_fields=["name"])
    assert Tenant.objects.get(pk=tenant.pk).name == "renamed"
    assert values() == [1]


def test_sync_and_tail_inside_an_atomic_block_do_nothing(probe_table):
    with transaction.atomic():
        with pipelined_atomic() as tx:
            insert(1)
            tx.sync()
            tx.pipeline_tail()
            insert(2)
    assert values() == [1, 2]


def test_an_error_raised_while_queueing_the_commit_still_leaves_pipeline_mode(
    probe_table, monkeypatch
):
    """psycopg reads what has arrived whenever it queues a statement, so a queued statement's
    error can surface on the COMMIT itself: the connection must not stay in pipeline mode."""
    queue = psycopg.Connection.execute

    def failing_commit(self, query, *args, **kwargs):
        if query == b"COMMIT":
            raise psycopg.errors.DivisionByZero("division by zero (a queued statement's)")
        return queue(self, query, *args, **kwargs)

    with pytest.raises(DatabaseError):
        with pipelined_atomic() as tx:
            insert(1)
            tx.sync()
            tx.pipeline_tail()
            monkeypatch.setattr(psycopg.Connection, "execute", failing_commit)
            insert(2)
    monkeypatch.undo()
    assert connection.connection is None or connection.connection._pipeline is None
    assert values() == []
    assert_back_in_autocommit()
