"""Run `serve`'s background jobs on APScheduler's AsyncIOScheduler.

Every job is a plain sync callable (:class:`fleet.engine.executor.PeriodicJob`).
It runs on a small thread pool of its own, never on the event loop, with
``close_old_connections()`` before and after so a dropped database connection
heals on the next tick.  ``leader_only`` jobs run only in the process that wins
the job's advisory lock for that tick.

A job that fails because the database cannot be reached logs one warning when the outage
begins (again each :data:`OUTAGE_REPEAT_S` while it lasts) and one line when it ends, not a
traceback per tick; any other failure keeps its traceback.  Once ``stop`` is called, a job
that fails or is cancelled on the way out (the pool closes under it) logs nothing above
debug: the shutdown is expected to end it.  APScheduler's own warning that a tick was skipped
because the last one still runs (a job waiting on a database that is gone, four times a
second for the fastest jobs) passes once per job each :data:`OUTAGE_REPEAT_S`, with a count
of the ones it held back (:class:`SkippedTicksFilter`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

from apscheduler.schedulers.asyncio import AsyncIOScheduler
from django.db import close_old_connections

from fleet.engine.executor import PeriodicJob
from fleet.engine.leader import run_as_leader
from fleet.platform.advisory_locks import lock_id_for
from fleet.platform.db_errors import database_unavailable, one_line

log = logging.getLogger(__name__)
SCHEDULER_LOG = logging.getLogger("apscheduler.scheduler")  # APScheduler's default logger

JOB_THREADS = 4
OUTAGE_REPEAT_S = 60.0  # how often a job still failing for want of a database says so again


class DatabaseOutages:
    """Which jobs are failing for want of a database, since when, and when they last said so."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failing: dict[str, tuple[float, float, int]] = {}  # name: since, said, failures

    def failed(self, name: str, now: float) -> tuple[bool, float, int]:
        """Count a failure; return (say it now, seconds since the outage began, failures)."""
        with self._lock:
            since, said, failures = self._failing.get(name, (now, -OUTAGE_REPEAT_S, 0))
            say = now - said >= OUTAGE_REPEAT_S
            self._failing[name] = (since, now if say else said, failures + 1)
            return say, now - since, failures + 1

    def recovered(self, name: str, now: float) -> tuple[float, int] | None:
        """Forget ``name``'s outage; return (its length, failures), or None if it had none."""
        with self._lock:
            outage = self._failing.pop(name, None)
        return None if outage is None else (now - outage[0], outage[2])


OUTAGES = DatabaseOutages()


class SkippedTicksFilter(logging.Filter):
    """Lets APScheduler's "skipped: maximum number of running instances" warning through once
    per job per :data:`OUTAGE_REPEAT_S`, counting the ones it drops in between."""

    def __init__(self, clock=time.monotonic) -> None:
        super().__init__()
        self._clock = clock
        self._lock = threading.Lock()
        self._jobs: dict[str, tuple[float, int]] = {}  # job id: last passed, dropped since

    def filter(self, record: logging.LogRecord) -> bool:
        if "maximum number of running instances" not in str(record.msg) or not record.args:
            return True
        job = record.args[0] if isinstance(record.args, tuple) else None
        key = str(getattr(job, "id", job))
        now = self._clock()
        with self._lock:
            passed, dropped = self._jobs.get(key, (now - OUTAGE_REPEAT_S, 0))
            if now - passed < OUTAGE_REPEAT_S:
                self._jobs[key] = (passed, dropped + 1)
                return False
            self._jobs[key] = (now, 0)
        if dropped:
            record.msg = f"{record.msg} ({dropped} more held back over %.0fs)"
            record.args = (*record.args, now - passed)
        return True


def run_job_once(
    job: PeriodicJob,
    stopping: threading.Event | None = None,
    outages: DatabaseOutages = OUTAGES,
) -> bool:
    """Run one tick of ``job`` in the calling thread; return whether it ran (leader-only may not).

    ``stopping`` is set once the server is shutting down (see the module)."""
    close_old_connections()
    try:
        ran = run_as_leader(lock_id_for(job.name), job.func) if job.leader_only else _run(job)
    except Exception as exc:
        _failed(job, exc, stopping, outages)
        return False
    finally:
        close_old_connections()
    recovered = outages.recovered(job.name, time.monotonic())
    if recovered is not None:
        log.info(
            "periodic job %s: the database is back after %.0fs (%d failed tick(s))",
            job.name,
            *recovered,
        )
    return ran


def _run(job: PeriodicJob) -> bool:
    job.func()
    return True


def _failed(
    job: PeriodicJob, exc: Exception, stopping: threading.Event | None, outages: DatabaseOutages
) -> None:
    if stopping is not None and stopping.is_set():
        log.debug("periodic job %s ended by the shutdown: %s", job.name, one_line(exc))
    elif not database_unavailable(exc):
        log.exception("periodic job %s failed", job.name)
    else:
        say, for_s, failures = outages.failed(job.name, time.monotonic())
        if say:
            log.warning(
                "periodic job %s: database unavailable for %.0fs (%d failed tick(s)), "
                "retrying every %gs: %s",
                job.name,
                for_s,
                failures,
                job.interval_s,
                one_line(exc),
            )


class PeriodicJobs:
    """The scheduler and its thread pool; ``start`` must be called on the running event loop."""

    def __init__(self, jobs: list[PeriodicJob], threads: int = JOB_THREADS) -> None:
        names = [job.name for job in jobs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate periodic job names: {duplicates}")
        self.jobs = list(jobs)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cloacina-job")
        self._stopping = threading.Event()
        self._skipped_ticks = SkippedTicksFilter()
        self._scheduler: AsyncIOScheduler | None = None

    def start(self) -> None:
        loop = asyncio.get_event_loop()
        self._scheduler = AsyncIOScheduler(event_loop=loop, timezone=UTC)
        now = datetime.now(UTC)
        for job in self.jobs:
            self._scheduler.add_job(
                self._runner(job),
                "interval",
                seconds=job.interval_s,
                id=job.name,
                name=job.name,
                next_run_time=now,
                max_instances=1,
                coalesce=True,
                misfire_grace_time=max(1, int(job.interval_s * 2)),
            )
        self._scheduler.start()
        SCHEDULER_LOG.addFilter(self._skipped_ticks)
        log.info("periodic jobs: %s", ", ".join(f"{j.name}/{j.interval_s:g}s" for j in self.jobs))

    def _runner(self, job: PeriodicJob):
        pool, stopping = self._pool, self._stopping

        async def run() -> None:
            try:
                await asyncio.get_running_loop().run_in_executor(pool, run_job_once, job, stopping)
            except asyncio.CancelledError:
                if not stopping.is_set():
                    raise
                # The shutdown cancelled the wait; the tick ends on its thread by itself.
                log.debug("periodic job %s: its wait cancelled by the shutdown", job.name)

        run.__name__ = job.name
        return run

    def stop(self) -> None:
        self._stopping.set()
        if self._scheduler is not None and self._scheduler.running:
            self._scheduler.shutdown(wait=False)
            SCHEDULER_LOG.removeFilter(self._skipped_ticks)
        self._pool.shutdown(wait=False, cancel_futures=True)
