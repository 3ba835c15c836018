"""What the database wrote during a bench phase: WAL and row versions of the hot tables.

CPU per task says how much the database worked; these counters say on what.  WAL bytes come
from the WAL position (exact); WAL records, full-page images and the tables' counters come
from the cumulative statistics, which a backend publishes late, so a phase's figures are
read after the longest delay (``settle_s``, :data:`STATS_DELAY_S`).
"""

from __future__ import annotations

import time

from django.db import connection

from agents.models import Agent
from fleet.models import DeliveryOutbox, TaskExecution, WorkflowExecution

# The tables a task's path writes on every placement, confirmation and result.
HOT_TABLES = tuple(
    model._meta.db_table for model in (TaskExecution, DeliveryOutbox, WorkflowExecution, Agent)
)
# A backend publishes its statistics at most once a second (PGSTAT_MIN_INTERVAL); one that
# goes idle less than a second after its last flush keeps them until an idle timeout of
# ten seconds (PGSTAT_IDLE_INTERVAL) — the server's pooled connections after a phase.
# Read after 1.1 s, a fifth of the burst's row versions were counted in the drain (exact
# from pg_waldump: 2.00 task versions per task in both; the counters said 1.50 and 2.27).
STATS_DELAY_S = 10.5


def snapshot(settle_s: float = STATS_DELAY_S) -> dict[str, float]:
    """The cumulative counters now: WAL bytes / records / full-page images, and per hot
    table its inserts, updates, HOT updates and deletes."""
    time.sleep(settle_s)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0'), wal_records, wal_fpi "
            "FROM pg_stat_wal"
        )
        wal_bytes, records, fpi = cursor.fetchone()
        counters = {"wal_bytes": float(wal_bytes), "wal_records": records, "wal_fpi": fpi}
        # New backends (a fork, an authentication and cold caches each), in every database.
        cursor.execute("SELECT sum(sessions) FROM pg_stat_database")
        counters["sessions"] = cursor.fetchone()[0] or 0
        cursor.execute(
            "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del "
            "FROM pg_stat_user_tables WHERE relname = ANY(%s)",
            [list(HOT_TABLES)],
        )
        for name, ins, upd, hot, dele in cursor.fetchall():
            counters.update({f"{name}.ins": ins, f"{name}.upd": upd, f"{name}.hot": hot})
            counters[f"{name}.del"] = dele
    return counters


def per_task(before: dict[str, float], after: dict[str, float], tasks: int) -> dict[str, str]:
    """The phase's work per task, formatted for a bench's settings line."""
    tasks = max(tasks, 1)

    def diff(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    figures = {
        "wal_bytes/task": f"{diff('wal_bytes') / tasks:.0f}",
        "wal_records/task": f"{diff('wal_records') / tasks:.1f}",
        "wal_fpi/task": f"{diff('wal_fpi') / tasks:.2f}",
        "db_sessions": f"{diff('sessions'):.0f}",
    }
    for table in HOT_TABLES:
        updates = diff(f"{table}.upd")
        short = table.split("_", 1)[1]
        figures[f"{short}_upd/task"] = f"{updates / tasks:.2f}"
        figures[f"{short}_hot%"] = (
            f"{100.0 * diff(f'{table}.hot') / updates:.0f}" if updates else "-"
        )
    return figures
