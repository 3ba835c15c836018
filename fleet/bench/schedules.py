"""`manage.py fleetbench --schedules N`: N cron schedules due in the same second on one
real `serve`; how long until every one has started its execution.

The schedules are written straight into the bench database (one transaction), each
with a 6-field expression naming one second a few seconds ahead, so they all come due
together and the server's firing tick has to claim, record and start all N.  Measured
from the rows: the fire time to each execution's creation (the lag the
``cloacina_schedule_fire_lag_seconds`` histogram shows), and to the last one.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db import transaction

from fleet.bench import workload
from fleet.bench.default import BENCH_TENANT, bench_tenant_key
from fleet.bench.server import Api, BenchServer
from fleet.models import Schedule, ScheduleFire, Tenant

LEAD_S = 6  # how far ahead the shared fire time is set: time to write N rows first
WAIT_S = 120.0
POLL_S = 0.1
WORKFLOW = "bench_schedule"


@dataclass
class ScheduleBenchResult:
    schedules: int
    fired: int
    all_started_s: float  # fire time to the last execution's creation
    visible_s: float  # fire time to this process seeing every fire committed (polled)
    lags_s: list[float]

    def table(self) -> str:
        lags = sorted(self.lags_s) or [0.0]

        def pct(p: float) -> float:
            return lags[min(len(lags) - 1, int(p * len(lags)))]

        return "\n".join(
            [
                f"schedules due in one second: {self.schedules}  started: {self.fired}",
                f"fire time -> all started:    {self.all_started_s:.3f} s "
                f"(all committed and visible by {self.visible_s:.2f} s, polled every {POLL_S:g} s)",
                f"lag p50 {pct(0.5):.3f} s  p95 {pct(0.95):.3f} s  max {lags[-1]:.3f} s  "
                f"mean {statistics.fmean(lags):.3f} s",
            ]
        )


def _one_second_cron(at: datetime) -> str:
    """A 6-field expression (seconds first) that fires at ``at`` (UTC), once a year."""
    return f"{at.second} {at.minute} {at.hour} {at.day} {at.month} *"


def _create(count: int, fire_at: datetime) -> None:
    tenant = Tenant.objects.get(name=BENCH_TENANT)
    cron = _one_second_cron(fire_at)
    with transaction.atomic():
        Schedule.objects.bulk_create(
            Schedule(
                tenant=tenant, workflow=WORKFLOW, cron=cron, timezone="UTC",
                context={"n": n}, next_fire_at=fire_at,
            )
            for n in range(count)
        )  # fmt: skip


def run_schedule_bench(database_url: str, count: int, workers: int) -> ScheduleBenchResult:
    key = bench_tenant_key()
    env = {"CLOACINA_WORKER_PROCESSES": str(workers)}
    with BenchServer(database_url, "default", **env) as server:
        Api(server.url, key).upload(workload.noop_package(WORKFLOW, 1))
        fire_at = (datetime.now(UTC) + timedelta(seconds=LEAD_S)).replace(microsecond=0)
        _create(count, fire_at)
        deadline = time.monotonic() + WAIT_S + LEAD_S
        fires = ScheduleFire.objects.filter(fire_time=fire_at, schedule__workflow=WORKFLOW)
        while fires.count() < count and time.monotonic() < deadline:
            time.sleep(POLL_S)
        visible_s = (datetime.now(UTC) - fire_at).total_seconds()
        created = list(
            fires.filter(outcome="started").values_list("execution__created_at", flat=True)
        )
        Schedule.objects.filter(workflow=WORKFLOW).update(enabled=False)
    lags = [(c - fire_at).total_seconds() for c in created]
    return ScheduleBenchResult(
        count, len(created), max(lags, default=float("nan")), visible_s, lags
    )
