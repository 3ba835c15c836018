"""Say why Ready tasks wait when no agent can take them.

While no agent of a tenant has room, the dispatch loop holds its events
(``FleetExecutor.has_capacity``) instead of claiming and releasing every
task over and over; this periodic job writes the reason on the waiting
rows instead, so the console and the API still say why a task waits.
"""

from __future__ import annotations

from django.db import connection

from fleet.executors.fleet.routing.candidates import no_capacity_reason
from fleet.executors.fleet.state import ledger
from fleet.platform.config import get_config

WAIT_REASON_INTERVAL_S = 2.0


def explain_waiting_tasks() -> int:
    """Set ``wait_reason`` on due Ready tasks of tenants with no agent slot free; return rows changed."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            SELECT DISTINCT t.tenant_id FROM fleet_taskexecution t
            WHERE t.status = 'Ready' AND (t.ready_at IS NULL OR t.ready_at <= statement_timestamp())
              AND NOT EXISTS (
                  SELECT 1 FROM {ledger.AGENTS} a
                  WHERE a.tenant_id = t.tenant_id AND a.state = 'live' AND a.connected_to <> ''
                    AND {ledger.has_free_slot("a")}
                    AND a.last_heartbeat > now() - make_interval(secs => %s)
              )
            """,
            [get_config().liveness_window_s],
        )
        tenants = [row[0] for row in cursor.fetchall()]
    changed = 0
    for tenant_id in tenants:
        reason = no_capacity_reason(tenant_id)
        with connection.cursor() as cursor:
            cursor.execute(
                """
                UPDATE fleet_taskexecution SET wait_reason = %s
                WHERE tenant_id = %s AND status = 'Ready'
                  AND (ready_at IS NULL OR ready_at <= statement_timestamp()) AND wait_reason <> %s
                """,
                [reason, tenant_id, reason],
            )
            changed += cursor.rowcount
    return changed
