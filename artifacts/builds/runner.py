"""Running queued builds in the background of `serve` (see artifacts/builds/jobs.py).

Each `serve` has a :class:`BuildRunner`: a periodic job claims queued builds
(at most ``CLOACINA_BUILD_CONCURRENCY`` running over every server) and hands
each to a thread of its own pool.  The thread reads what the build needs,
**closes its database connection** while pip runs (up to
``wheels.PIP_TIMEOUT_S``), then reconnects to publish the artifact and record
the outcome — so a slow index or a hostile requirements file holds no pooled
connection, and no request waits for pip.  A leader-only periodic job puts
back the running builds of servers that died.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from django.db import close_old_connections, connection

from artifacts.builds import jobs as build_jobs
from artifacts.models import BuildJob
from artifacts.store import wheels
from artifacts.store.services import UploadRejected, publish_target_artifact
from fleet.engine import server_registry
from fleet.engine.executor import PeriodicJob
from fleet.platform.config import Config, get_config
from fleet.platform.errors import ErrorKind

log = logging.getLogger(__name__)

CLAIM_POLL_S = 1.0  # how soon a queued build starts when a slot is free


class BuildRunner:
    """Claims queued builds for this server and runs them on ``concurrency`` threads."""

    def __init__(self, server: str, config: Config | None = None) -> None:
        self.server = server
        self.config = config or get_config()
        self.concurrency = self.config.build_concurrency
        self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="cloacina-build")
        self._lock = threading.Lock()
        self._busy = 0
        self._stop = threading.Event()

    def periodic_jobs(self) -> list[PeriodicJob]:
        return [
            PeriodicJob("start_builds", self.start_builds, CLAIM_POLL_S),
            PeriodicJob(
                "recover_orphaned_builds",
                build_jobs.recover_orphaned_builds,
                server_registry.heartbeat_interval_s(),
                leader_only=True,
            ),
        ]

    def start_builds(self) -> int:
        """Claim as many queued builds as this server has free threads; start them."""
        if self._stop.is_set():
            return 0
        with self._lock:
            free = self.concurrency - self._busy
        jobs = build_jobs.claim_builds(self.server, free, self.concurrency)
        for job in jobs:
            with self._lock:
                self._busy += 1
            self._pool.submit(self._run_in_thread, job)
        return len(jobs)

    def _run_in_thread(self, job: BuildJob) -> None:
        try:
            run_build(job, self._stop)
        finally:
            connection.close()  # back to the pool until this thread's next build
            with self._lock:
                self._busy -= 1

    def run_pending(self) -> int:
        """Claim and run queued builds in the calling thread until none is left (tests,
        one-off tools); returns how many ran."""
        ran = 0
        while jobs := build_jobs.claim_builds(self.server, 1, self.concurrency):
            run_build(jobs[0], self._stop)
            ran += 1
        return ran

    def stop(self) -> int:
        """Kill running pips (their threads queue the builds again) and release what is left."""
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        close_old_connections()
        try:
            return build_jobs.release_builds_of(self.server, f"server {self.server} shut down")
        finally:
            close_old_connections()


def run_build(job: BuildJob, stop: threading.Event | None = None) -> None:
    """Run one claimed build to its outcome (recorded on the job row)."""
    close_old_connections()
    meter = wheels.DownloadMeter()
    try:
        build = wheels.prepare_build(job.tenant, job.package_name, job.version, job.target_triple)
        # No connection is held while pip runs: it goes back to the pool here and the
        # next query below takes one again.
        connection.close()
        built = wheels.vendored_archive(build, job.target_triple, meter=meter, stop=stop)
        artifact, created = publish_target_artifact(
            job.tenant, build.package.name, build.package.version, job.target_triple, built
        )
        build_jobs.succeed_build(job, artifact.content_hash, created, meter.bytes)
        log.info("build %s succeeded: %s", job.pk, artifact.content_hash)
    except wheels.BuildInterrupted as exc:
        build_jobs.requeue_build(job, str(exc))
    except UploadRejected as exc:
        build_jobs.fail_build(job, exc.kind, exc.detail, meter.bytes)
        log.info("build %s failed (%s): %s", job.pk, exc.kind, exc.detail)
    except Exception as exc:
        log.exception("build %s crashed", job.pk)
        detail = f"the build failed unexpectedly ({type(exc).__name__}); see the server log"
        build_jobs.fail_build(job, ErrorKind.INTERNAL, detail, meter.bytes)
    finally:
        close_old_connections()
