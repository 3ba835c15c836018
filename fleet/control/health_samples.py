"""Per-tenant health samples: the one writer (and pruner) of ``TenantHealthSample``.

Every minute the leader writes one row per active tenant: the tasks that completed and
failed since the previous sample, their Ready→started latency (p50 and p95 of the
attempt that finished), the live agents and the tenant's desired_count.  The console
draws them beside the outbox depth (fleet/console/health.py).

Windows chain: each one starts where the last sample ended (at most ``MAX_WINDOW_S``
back, so a leader that was away for an hour does not lump the hour into one minute),
so no finished task is counted twice or missed when the ticks drift.  Rates are
shown per minute of the actual window.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import connection
from django.db.models import Count, Max
from django.utils import timezone

from agents.models import Agent, AgentState
from fleet.engine.executor import PeriodicJob
from fleet.models import TaskStatus, Tenant, TenantHealthSample

SAMPLE_INTERVAL_S = 60.0
MAX_WINDOW_S = 5 * SAMPLE_INTERVAL_S
RETENTION_S = 7 * 24 * 3600.0  # as the outbox depth samples: the charts' longest useful range
PRUNE_INTERVAL_S = 600.0
PRUNE_BATCH = 20_000  # rows per DELETE, so one sweep never holds long locks

# Tasks that finished in the window, grouped per tenant.  Latency is Ready→started of the
# attempt that finished: ready_at is when it became due (a retry's backoff included),
# started_at when it was claimed for that attempt.  The partial index on finished_at
# keeps this to the window's rows, however long the history.
FINISHED_IN_WINDOW = """
    SELECT tenant_id,
           count(*) FILTER (WHERE status = %(completed)s),
           count(*) FILTER (WHERE status = %(failed)s),
           percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM started_at - ready_at))
               FILTER (WHERE started_at >= ready_at),
           percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM started_at - ready_at))
               FILTER (WHERE started_at >= ready_at)
    FROM fleet_taskexecution
    WHERE finished_at > %(since)s AND finished_at <= %(until)s
      AND finished_at IS NOT NULL AND status IN (%(completed)s, %(failed)s)
    GROUP BY tenant_id
"""


def window_start(now: datetime) -> datetime:
    """Where this window starts: the previous sample's end, bounded to MAX_WINDOW_S back."""
    last = TenantHealthSample.objects.aggregate(last=Max("at"))["last"]
    earliest = now - timedelta(seconds=MAX_WINDOW_S)
    if last is None:
        return now - timedelta(seconds=SAMPLE_INTERVAL_S)
    return min(max(last, earliest), now)


def sample_tenant_health(now: datetime | None = None) -> int:
    """Write one sample per active tenant (zeros included); return how many."""
    now = now or timezone.now()
    since = window_start(now)
    window_s = (now - since).total_seconds()
    if window_s <= 0:
        return 0  # another tick already sampled this instant
    with connection.cursor() as cursor:
        cursor.execute(
            FINISHED_IN_WINDOW,
            {
                "since": since,
                "until": now,
                "completed": TaskStatus.COMPLETED,
                "failed": TaskStatus.FAILED,
            },
        )
        finished = {row[0]: row[1:] for row in cursor.fetchall()}
    live = dict(
        Agent.objects.filter(state=AgentState.LIVE)
        .values_list("tenant_id")
        .annotate(n=Count("id"))
        .values_list("tenant_id", "n")
    )
    samples = []
    for tenant_id, desired in Tenant.objects.filter(is_active=True).values_list(
        "id", "desired_count"
    ):
        completed, failed, p50, p95 = finished.get(tenant_id, (0, 0, None, None))
        samples.append(
            TenantHealthSample(
                tenant_id=tenant_id,
                at=now,
                window_s=window_s,
                completed=completed,
                failed=failed,
                latency_p50_s=p50,
                latency_p95_s=p95,
                agents_live=live.get(tenant_id, 0),
                desired_count=desired,
            )
        )
    TenantHealthSample.objects.bulk_create(samples, batch_size=1000)
    return len(samples)


def prune_health_samples(retention_s: float = RETENTION_S, batch: int = PRUNE_BATCH) -> int:
    """Delete samples older than ``retention_s``, a batch at a time; return how many."""
    total = 0
    while True:
        with connection.cursor() as cursor:
            cursor.execute(
                "DELETE FROM fleet_tenanthealthsample WHERE id IN ("
                " SELECT id FROM fleet_tenanthealthsample"
                " WHERE at < now() - make_interval(secs => %s) LIMIT %s)",
                [retention_s, batch],
            )
            deleted = cursor.rowcount
        total += deleted
        if deleted < batch:
            return total


def health_sample_jobs() -> list[PeriodicJob]:
    """The sampler every minute and the pruner every ten, leader-only like the depth sampler."""
    return [
        PeriodicJob(
            "tenant_health_samples", sample_tenant_health, SAMPLE_INTERVAL_S, leader_only=True
        ),
        PeriodicJob(
            "tenant_health_prune", prune_health_samples, PRUNE_INTERVAL_S, leader_only=True
        ),
    ]
