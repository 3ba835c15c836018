"""The ``default`` executor: runs tasks on this server, in the task runner's child processes.

One run: claim the task (the fencing token), resolve its package through the
unpacked-package cache, build the input with the shared context builder, run
it under its timeout in a child process, and hand the outcome to the one
result handler.  Anything that goes wrong after the claim becomes a failure
report naming the problem (it counts as an attempt), so a task never stays
Running because of this executor.

The database work is batched (:class:`~fleet.engine.batcher.Batcher`): the runs
that start while one batch is being prepared are claimed together (one claim
statement, which also reads their contexts and package digests), and the outcomes that arrive while one batch is
being recorded are recorded together (one transaction, one synchronous commit).
On an idle server a batch is a single run and waits for nothing; under load the
round trips, thread hand-offs and WAL flushes are shared by the whole batch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from django.db import DatabaseError

from agents.sandbox.archive import ArchiveError
from agents.sandbox.package_cache import PackageCache, PackageCacheError
from agents.sandbox.task_log import LiveTail, LogChunk
from agents.sandbox.task_runner import RunOutcome, TaskRunner, TaskRunnerClosed
from artifacts.store.storage import load_blob
from fleet.engine import ready_queue, task_logs
from fleet.engine.batcher import Batcher
from fleet.engine.claims import Claim, claim_work, release_claim
from fleet.engine.context import encode_context
from fleet.engine.db_threads import DbThreadPool
from fleet.engine.events import ExecutionResult, ExecutionStatus, ExecutorMetrics, TaskReadyEvent
from fleet.engine.executor import TaskExecutor
from fleet.engine.outcome_batches import apply_reports
from fleet.engine.results import Applied, TaskReport
from fleet.models import Outcome
from fleet.platform.config import get_config

log = logging.getLogger(__name__)

EXECUTOR_KEY = "default"
DEFAULT_CACHE_BYTES = 2 * 1024**3
# Capacity is one run per child, never more: a run claimed ahead would wait for a child
# while its result deadline (timeout + grace, set at the claim) ran down, and a long wait
# would get a live run declared lost.  Database threads are twice that, so recording
# finished runs never delays preparing the next ones.
DB_THREADS_PER_WORKER = 2
# On stop, in-flight runs get this long to finish before their children are killed.
# Shorter than serve's own stop timeout, so closing the children and connections still fits.
DRAIN_TIMEOUT_S = 20.0
# Recording an outcome survives a short database outage (the handler is idempotent).
APPLY_ATTEMPTS = 5
APPLY_RETRY_S = 0.5
# Outcomes recorded in one transaction, at most; two batches may be written at once
# (apply_reports takes rows in one order, so they cannot deadlock), so one waiting for
# its commit's WAL flush does not hold up the next.
RESULT_BATCH = 64
RESULT_BATCHES_AT_ONCE = 2
_OUTCOME_BY_STATUS = {"success": Outcome.SUCCESS, "failure": Outcome.FAILURE}


@dataclass(frozen=True)
class _Prepared:
    """A claimed task ready to run, or the reason it cannot (``error_type`` set)."""

    claim: Claim
    digest: str = ""
    package_dir: Path | None = None
    context_json: str = ""
    error_type: str = ""
    error_message: str = ""


def report_for(claim: Claim, outcome: RunOutcome) -> TaskReport:
    """The result handler's view of one run."""
    if outcome.status == "success":
        return TaskReport(
            claim.task_execution_id,
            claim.assignment,
            Outcome.SUCCESS,
            output=outcome.output,
            log=outcome.log,
        )
    return TaskReport(
        claim.task_execution_id,
        claim.assignment,
        _OUTCOME_BY_STATUS.get(outcome.status, Outcome.TIMEOUT),
        error_type=outcome.error_type,
        error_message=outcome.error_message,
        traceback=outcome.traceback,
        log=outcome.log,
    )


class InProcessExecutor(TaskExecutor):
    key = EXECUTOR_KEY

    def __init__(
        self,
        workers: int,
        claimer: str,
        cache_root: Path,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
        runner: TaskRunner | None = None,
    ) -> None:
        """``runner``: the task runner to run in (default: ``workers`` reused children); an
        executor built on this one passes its own (limits, a child per task, …)."""
        if runner is not None and runner.capacity != workers:
            raise ValueError(f"the runner has {runner.capacity} children, not {workers}")
        self.workers = workers
        self.claimer = claimer
        self.runner = runner or TaskRunner(workers, log_bytes=get_config().task_log_bytes)
        self.cache = PackageCache(Path(cache_root), cache_bytes)
        self.drain_timeout_s = drain_timeout_s
        self._db: DbThreadPool | None = None
        self._preparer: Batcher[uuid.UUID, _Prepared | None] | None = None
        self._recorder: Batcher[tuple[uuid.UUID, TaskReport], Applied] | None = None
        self._holding = 0  # runs between claim and the child's answer: what uses a slot
        self._in_flight = 0  # runs anywhere in execute(), outcome recording included
        self._stopping = False
        self._lock = threading.Lock()
        self._executed = 0
        self._failed = 0
        self._total_duration_s = 0.0

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        self.runner.require_reachable(self.cache.root, "the package cache")
        await asyncio.to_thread(self.runner.start)
        self._db = DbThreadPool(
            self.workers * DB_THREADS_PER_WORKER, "inprocess-db", hot_path="cloacina-inprocess"
        )
        self._stopping = False

    async def stop(self) -> None:
        """Stop taking work, let runs in flight finish (up to the drain timeout), then close."""
        self._stopping = True
        await self._wait_idle(self.drain_timeout_s)
        await asyncio.to_thread(self.runner.close)
        await self._wait_idle(5.0)  # killed runs record their outcome
        for batcher in (self._preparer, self._recorder):
            if batcher is not None and batcher.loop is asyncio.get_running_loop():
                await batcher.close()
        self._preparer = self._recorder = None
        if self._db is not None:
            await asyncio.to_thread(self._db.close)

    async def _wait_idle(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)

    # -- TaskExecutor --------------------------------------------------------------

    def has_capacity(self) -> bool:
        return not self._stopping and self._db is not None and self._holding < self.workers

    def metrics(self) -> ExecutorMetrics:
        done = self._executed
        return ExecutorMetrics(
            active_tasks=self._holding,
            max_concurrent=self.workers,
            total_executed=self._executed,
            total_failed=self._failed,
            avg_duration_ms=(self._total_duration_s / done * 1000.0) if done else 0.0,
            extra={
                "recording": self._in_flight - self._holding,
                "cache_hits": self.cache.hits,
                "cache_misses": self.cache.misses,
                "runner_busy": self.runner.busy,
            },
        )

    async def execute(self, event: TaskReadyEvent) -> ExecutionResult:
        if self._db is None:
            raise RuntimeError("the in-process executor is not started")
        preparer, _recorder = self._batchers()
        with self._lock:
            self._holding += 1
            self._in_flight += 1
        holding = True
        try:
            prepared = await preparer.submit(event.task_execution_id)
            if prepared is None:
                return ExecutionResult(
                    event.task_execution_id,
                    ExecutionStatus.SUPERSEDED,
                    "not claimed: another claimer got it first, or it is not due",
                )
            outcome = await self._run(prepared)
            with self._lock:
                self._holding -= 1
            holding = False
            self.capacity_freed()  # the next task may start while this outcome is recorded
            if outcome is None:  # stopped before or while it ran: given back, not an attempt
                released = await self._db.call(
                    release_claim,
                    prepared.claim.task_execution_id,
                    prepared.claim.assignment,
                    "the server stopped before the task finished",
                )
                status = ExecutionStatus.REQUEUED if released else ExecutionStatus.SUPERSEDED
                return ExecutionResult(event.task_execution_id, status, "runner closed")
            applied = await self._record(prepared.claim, report_for(prepared.claim, outcome))
            ready_queue.submit(applied.ready)
            self._count(outcome)
            error = applied.reason or outcome.error_message or None
            return ExecutionResult(
                event.task_execution_id, applied.status, error, outcome.duration_s
            )
        finally:
            with self._lock:
                if holding:
                    self._holding -= 1
                self._in_flight -= 1
            if holding:
                self.capacity_freed()

    # -- steps ---------------------------------------------------------------------

    def _batchers(self) -> tuple[Batcher, Batcher]:
        """The prepare and result batchers of the running event loop (made on first use: a
        server has one loop; tests drive an executor from several in turn)."""
        loop = asyncio.get_running_loop()
        if self._preparer is None or self._preparer.loop is not loop:
            # A prepare batch is at most one run per child (capacity): preparing two at
            # once would only split it.
            self._preparer = Batcher(
                self._prepare_batch, self.workers, "inprocess-prepare", self._db.call
            )
            self._recorder = Batcher(
                apply_reports,
                RESULT_BATCH,
                "inprocess-results",
                self._db.call,
                RESULT_BATCHES_AT_ONCE,
            )
        return self._preparer, self._recorder

    def _prepare_batch(self, task_execution_ids: list[uuid.UUID]) -> list[_Prepared | None]:
        """Claim these tasks in one statement that also reads each one's context and package
        digest, then resolve each package (database thread).  None for a task not claimed
        (someone else got it, not due)."""
        claimed = {
            work.claim.task_execution_id: work
            for work in claim_work(task_execution_ids, self.claimer)
        }
        prepared = {
            task_execution_id: self._resolve(work.claim, work.package.digest, work.context)
            for task_execution_id, work in claimed.items()
        }
        return _each_once(task_execution_ids, prepared)

    def _resolve(self, claim: Claim, digest: str, context: dict) -> _Prepared:
        """The claimed task's unpacked package (pinned until its run ends) and input."""
        try:
            context_json = encode_context(context)
            self.cache.pin(digest)
            try:
                package_dir = self.cache.get(digest, partial(_load_blob, digest))
            except BaseException:
                self.cache.unpin(digest)
                raise
            return _Prepared(claim, digest, package_dir, context_json)
        except (LookupError, PackageCacheError, ArchiveError) as exc:
            return _Prepared(
                claim,
                error_type="PackageUnavailable",
                error_message=f"package {digest or '?'} could not be loaded: {_describe(exc)}",
            )
        except Exception as exc:
            log.exception("preparing task %s failed", claim.task_execution_id)
            return _Prepared(
                claim,
                error_type=type(exc).__name__,
                error_message=f"could not prepare the task: {exc}",
            )

    async def _run(self, prepared: _Prepared) -> RunOutcome | None:
        if prepared.error_type:
            return RunOutcome("failure", None, prepared.error_type, prepared.error_message)
        claim = prepared.claim
        ring = self.runner.new_log()
        tail = LiveTail(ring, partial(self._ship_live, claim))
        try:
            outcome = await self.runner.run(
                prepared.package_dir, claim.function, prepared.context_json, claim.timeout_s, ring
            )
        except TaskRunnerClosed:
            return None
        except Exception as exc:
            log.exception("running task %s failed in the runner", claim.task_execution_id)
            return RunOutcome("failure", None, "ExecutorError", f"the task runner failed: {exc}")
        finally:
            tail.stop()
            self.cache.unpin(prepared.digest)
        if outcome.error_type == "TaskRunnerClosed":
            return None
        return outcome

    async def _ship_live(self, claim: Claim, chunk: LogChunk) -> None:
        """A running task's new output, for the console's live tail (fenced on the claim)."""
        live = task_logs.LiveChunk(
            claim.task_execution_id, claim.assignment, chunk.text, chunk.end, chunk.skipped
        )
        await self._db.call(task_logs.append_live, live, claim.tenant_id)

    async def _record(self, claim: Claim, report: TaskReport) -> Applied:
        for attempt in range(1, APPLY_ATTEMPTS + 1):
            try:
                return await self._batchers()[1].submit((claim.workflow_execution_id, report))
            except DatabaseError as exc:
                if attempt == APPLY_ATTEMPTS:
                    # The task stays Running; the lost-run sweep reports it at its deadline.
                    log.error(
                        "could not record the outcome of %s: %s", report.task_execution_id, exc
                    )
                    return Applied(False, ExecutionStatus.FAILED, f"outcome not recorded: {exc}")
                await asyncio.sleep(APPLY_RETRY_S * attempt)
        raise AssertionError("unreachable")

    def _count(self, outcome: RunOutcome) -> None:
        with self._lock:
            self._executed += 1
            if outcome.status != "success":
                self._failed += 1
            self._total_duration_s += outcome.duration_s


def _each_once(task_execution_ids: list[uuid.UUID], prepared: dict[uuid.UUID, _Prepared]) -> list:
    """The answers in the order of ``task_execution_ids``: a task offered twice in one batch was claimed
    once, so only its first offer gets the claim (the other is not claimed, None)."""
    return [prepared.pop(task_execution_id, None) for task_execution_id in task_execution_ids]


def _load_blob(digest: str) -> bytes:
    return load_blob(digest)


def _describe(exc: BaseException) -> str:
    if type(exc).__name__ == "BlobNotFound":
        return "its bytes are missing from the artifact store"
    return str(exc) or type(exc).__name__
