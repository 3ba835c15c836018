"""Housekeeping of the outbox: acked rows older than the retention window are deleted.

Acked rows are history (the console's eviction page shows where reclaimed work
went); open rows are never touched here, so the open-row gauge stays exact.
"""

from __future__ import annotations

from django.db import connection

from fleet.executors.fleet.state import ledger
from fleet.platform.config import get_config

PRUNE_BATCH = 5000  # rows per DELETE, so one sweep never holds long locks
DEPTH_SAMPLE_RETENTION_S = 7 * 24 * 3600.0


def prune_acked(retention_s: float | None = None, batch: int = PRUNE_BATCH) -> int:
    """Delete acked rows acked more than ``retention_s`` ago; return how many."""
    seconds = get_config().outbox_retention_s if retention_s is None else retention_s
    total = 0
    while True:
        with connection.cursor() as cursor:
            cursor.execute(ledger.PRUNE_ACKED, [seconds, batch])
            deleted = cursor.rowcount
        total += deleted
        if deleted < batch:
            return total


def prune_depth_samples(retention_s: float = DEPTH_SAMPLE_RETENTION_S) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "DELETE FROM fleet_outboxdepthsample WHERE at < now() - make_interval(secs => %s)",
            [retention_s],
        )
        return cursor.rowcount
