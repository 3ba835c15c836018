"""Run `serve`'s background jobs on APScheduler's AsyncIOScheduler.

Every job is a plain sync callable (:class:`fleet.engine.executor.PeriodicJob`).
It runs on a small thread pool of its own, never on the event loop, with
``close_old_connections()`` before and after so a dropped database connection
heals on the next tick.  ``leader_only`` jobs run only in the process that wins
the job's advisory lock for that tick.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

from apscheduler.schedulers.asyncio import AsyncIOScheduler
from django.db import close_old_connections

from fleet.engine.executor import PeriodicJob
from fleet.engine.leader import run_as_leader
from fleet.platform.advisory_locks import lock_id_for

log = logging.getLogger(__name__)

JOB_THREADS = 4


def run_job_once(job: PeriodicJob) -> bool:
    """Run one tick of ``job`` in the calling thread; return whether it ran (leader-only may not)."""
    close_old_connections()
    try:
        if job.leader_only:
            return run_as_leader(lock_id_for(job.name), job.func)
        job.func()
        return True
    except Exception:
        log.exception("periodic job %s failed", job.name)
        return False
    finally:
        close_old_connections()


class PeriodicJobs:
    """The scheduler and its thread pool; ``start`` must be called on the running event loop."""

    def __init__(self, jobs: list[PeriodicJob], threads: int = JOB_THREADS) -> None:
        names = [job.name for job in jobs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate periodic job names: {duplicates}")
        self.jobs = list(jobs)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cloacina-job")
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
        log.info("periodic jobs: %s", ", ".join(f"{j.name}/{j.interval_s:g}s" for j in self.jobs))

    def _runner(self, job: PeriodicJob):
        pool = self._pool

        async def run() -> None:
            await asyncio.get_running_loop().run_in_executor(pool, run_job_once, job)

        run.__name__ = job.name
        return run

    def stop(self) -> None:
        if self._scheduler is not None and self._scheduler.running:
            self._scheduler.shutdown(wait=False)
        self._pool.shutdown(wait=False, cancel_futures=True)
