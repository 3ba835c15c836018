"""fleetbench's database figures per task (fleet/bench/db_work.py): differences of the
cumulative counters over a phase, divided by its tasks."""

from __future__ import annotations

from fleet.bench.db_work import per_task


def test_a_phases_writes_are_counted_per_task():
    before = {"wal_bytes": 1_000.0, "wal_records": 10, "wal_fpi": 0, "sessions": 5}
    before |= {"delivery_outbox.upd": 100, "delivery_outbox.hot": 20}
    after = {"wal_bytes": 41_000.0, "wal_records": 410, "wal_fpi": 4, "sessions": 6}
    after |= {"delivery_outbox.upd": 140, "delivery_outbox.hot": 40}
    figures = per_task(before, after, tasks=8)
    assert figures["wal_bytes/task"] == "5000"
    assert figures["wal_records/task"] == "50.0"
    assert figures["wal_fpi/task"] == "0.50"
    assert figures["db_sessions"] == "1"  # in the phase, not per task
    assert figures["outbox_upd/task"] == "5.00"
    assert figures["outbox_hot%"] == "50"  # 20 of the phase's 40 updates


def test_a_table_without_updates_has_no_hot_share():
    figures = per_task({}, {"wal_bytes": 0.0}, tasks=0)
    assert figures["taskexecution_upd/task"] == "0.00"
    assert figures["taskexecution_hot%"] == "-"
