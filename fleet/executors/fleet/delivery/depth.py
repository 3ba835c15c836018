"""Outbox depth samples per tenant, for the console's depth-over-time chart."""

from __future__ import annotations

from django.db import connection

from fleet.executors.fleet.state import ledger

SAMPLE_INTERVAL_S = 10.0


def sample_outbox_depth() -> int:
    """Write one OutboxDepthSample per active tenant (zeros included); return how many."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            INSERT INTO fleet_outboxdepthsample (tenant_id, at, pending, delivered, oldest_pending_age_s)
            SELECT t.id, now(),
                   count(o.id) FILTER (WHERE o.state = 'pending'),
                   count(o.id) FILTER (WHERE o.state = 'delivered'),
                   coalesce(extract(epoch FROM now() - min(o.updated_at) FILTER (WHERE o.state = 'pending')), 0)
            FROM fleet_tenant t
            LEFT JOIN {ledger.OUTBOX} o ON o.tenant_id = t.id AND {ledger.open_row("o")}
            WHERE t.is_active
            GROUP BY t.id
            """
        )
        return cursor.rowcount
