"""A database that cannot be reached is logged as one line, not a traceback per tick
(fleet/platform/db_errors.py, fleet/engine/periodic.py): what counts as unreachable, the
outage's first warning, its repeat, its end, and quiet failures once the server is stopping."""

from __future__ import annotations

import asyncio
import logging
import threading

import django.db
import psycopg
import pytest
from psycopg import errors
from psycopg_pool import PoolClosed, PoolTimeout

from fleet.engine import periodic
from fleet.engine.executor import PeriodicJob
from fleet.engine.periodic import OUTAGE_REPEAT_S, DatabaseOutages, PeriodicJobs, run_job_once
from fleet.platform.db_errors import database_unavailable, one_line

GONE = "consuming input failed: server closed the connection unexpectedly\n\tThis probably..."


def wrapped(cause: BaseException) -> django.db.OperationalError:
    """What Django raises: its own error, raised from psycopg's."""
    try:
        try:
            raise cause
        except psycopg.Error as exc:
            raise django.db.OperationalError(str(exc)) from exc
    except django.db.OperationalError as exc:
        return exc


@pytest.mark.parametrize(
    "exc",
    [
        psycopg.OperationalError(GONE),  # the socket failed: no SQLSTATE
        PoolTimeout("couldn't get a connection after 2.00 sec"),
        PoolClosed("the pool 'pool-1' is closed"),
        errors.AdminShutdown("terminating connection due to administrator command"),
        errors.CannotConnectNow("the database system is starting up"),
        errors.TooManyConnections("sorry, too many clients already"),
        errors.ConnectionFailure("connection failure"),
        wrapped(psycopg.OperationalError(GONE)),
        wrapped(PoolClosed("the pool 'pool-1' is closed")),
    ],
    ids=lambda e: type(e).__name__,
)
def test_these_say_the_database_cannot_be_reached(exc):
    assert database_unavailable(exc) is True


@pytest.mark.parametrize(
    "exc",
    [
        errors.DeadlockDetected("deadlock detected"),
        errors.QueryCanceled("canceling statement due to statement timeout"),
        errors.SerializationFailure("could not serialize access"),
        errors.UniqueViolation("duplicate key"),
        wrapped(errors.DeadlockDetected("deadlock detected")),
        RuntimeError("kaput"),
        django.db.OperationalError("no cause"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_these_are_failures_of_the_statement_or_the_code(exc):
    assert database_unavailable(exc) is False


def test_one_line_keeps_libpq_s_first_line():
    assert one_line(psycopg.OperationalError(GONE)) == GONE.splitlines()[0]
    assert one_line(RuntimeError()) == "RuntimeError"


def failing(exc: BaseException) -> PeriodicJob:
    def func():
        raise exc

    return PeriodicJob("flaky_job", func, 2.0)


def records(caplog, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == periodic.log.name and r.levelno == level]


def test_an_outage_warns_once_then_again_after_the_repeat_then_says_it_ended(caplog, monkeypatch):
    caplog.set_level(logging.DEBUG, logger=periodic.log.name)
    clock = [1000.0]
    monkeypatch.setattr(periodic.time, "monotonic", lambda: clock[0])
    outages = DatabaseOutages()
    job = failing(wrapped(psycopg.OperationalError(GONE)))
    for _ in range(5):
        assert run_job_once(job, outages=outages) is False
        clock[0] += 2.0
    warnings = records(caplog, logging.WARNING)
    assert len(warnings) == 1 and warnings[0].exc_info is None
    assert "flaky_job: database unavailable" in warnings[0].getMessage()
    assert "consuming input failed" in warnings[0].getMessage()
    assert not records(caplog, logging.ERROR)

    clock[0] += OUTAGE_REPEAT_S
    assert run_job_once(job, outages=outages) is False
    warnings = records(caplog, logging.WARNING)
    assert len(warnings) == 2 and "(6 failed tick(s))" in warnings[1].getMessage()

    ok = PeriodicJob("flaky_job", lambda: None, 2.0)
    assert run_job_once(ok, outages=outages) is True
    (back,) = records(caplog, logging.INFO)
    assert "flaky_job: the database is back after 70s (6 failed tick(s))" in back.getMessage()
    assert run_job_once(ok, outages=outages) is True  # said once
    assert len(records(caplog, logging.INFO)) == 1


def test_any_other_failure_keeps_its_traceback_every_time(caplog):
    outages = DatabaseOutages()
    job = failing(errors.DeadlockDetected("deadlock detected"))
    assert run_job_once(job, outages=outages) is False
    assert run_job_once(job, outages=outages) is False
    errors_logged = records(caplog, logging.ERROR)
    assert len(errors_logged) == 2 and all(r.exc_info for r in errors_logged)


def test_once_stopping_a_failing_tick_logs_nothing_above_debug(caplog):
    caplog.set_level(logging.DEBUG, logger=periodic.log.name)
    stopping = threading.Event()
    stopping.set()
    for exc in (PoolClosed("the pool 'pool-1' is closed"), RuntimeError("kaput")):
        assert run_job_once(failing(exc), stopping, DatabaseOutages()) is False
    assert [r.levelno for r in caplog.records if r.name == periodic.log.name] == [logging.DEBUG] * 2


def test_a_wait_cancelled_by_stop_is_not_an_error_but_any_other_cancel_is():
    release = threading.Event()
    jobs = PeriodicJobs([PeriodicJob("slow", lambda: release.wait(5), 60.0)], threads=1)
    run = jobs._runner(jobs.jobs[0])

    async def cancel(stop_first: bool) -> None:
        task = asyncio.ensure_future(run())
        await asyncio.sleep(0.05)  # the tick is now waiting on its thread
        if stop_first:
            jobs._stopping.set()
        task.cancel()
        await task

    try:
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(cancel(stop_first=False))
        asyncio.run(cancel(stop_first=True))  # returns quietly
    finally:
        release.set()
        jobs.stop()


def skipped_record(job_id: str) -> logging.LogRecord:
    """APScheduler's warning, as its scheduler makes it (the job object is the first arg)."""

    class Job:
        id = job_id

        def __str__(self) -> str:
            return f"{job_id} (trigger: interval[0:00:00.250000])"

    return logging.LogRecord(
        "apscheduler.scheduler",
        logging.WARNING,
        __file__,
        1,
        'Execution of job "%s" skipped: maximum number of running instances reached (%d)',
        (Job(), 1),
        None,
    )


def test_skipped_tick_warnings_pass_once_per_job_per_minute_with_a_count():
    clock = [0.0]
    skipped = periodic.SkippedTicksFilter(clock=lambda: clock[0])
    assert skipped.filter(skipped_record("sweep")) is True
    assert skipped.filter(skipped_record("other")) is True  # counted per job
    for _ in range(239):  # four a second for a minute less a tick
        clock[0] += 0.25
        assert skipped.filter(skipped_record("sweep")) is False
    clock[0] = OUTAGE_REPEAT_S
    record = skipped_record("sweep")
    assert skipped.filter(record) is True
    assert record.getMessage().endswith("reached (1) (239 more held back over 60s)")
    unrelated = logging.LogRecord("apscheduler.scheduler", logging.INFO, __file__, 1, "x", (), None)
    assert skipped.filter(unrelated) is True


def test_the_filter_sits_on_apscheduler_s_logger_while_the_jobs_run():
    jobs = PeriodicJobs([PeriodicJob("idle", lambda: None, 60.0)], threads=1)

    async def run() -> bool:
        jobs.start()
        try:
            return jobs._skipped_ticks in periodic.SCHEDULER_LOG.filters
        finally:
            jobs.stop()

    assert asyncio.run(run()) is True
    assert jobs._skipped_ticks not in periodic.SCHEDULER_LOG.filters
