"""The ``default`` executor: runs tasks on this server, in the task runner's child processes.

One run: claim the task (the fencing token), resolve its package through the
unpacked-package cache, build the input with the shared context builder, run
it under its timeout in a child process, and hand the outcome to the one
result handler.  Anything that goes wrong after the claim becomes a failure
report naming the problem (it counts as an attempt), so a task never stays
Running because of this executor.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from django.db import DatabaseError

from agents.runtime.archive import ArchiveError
from agents.runtime.package_cache import PackageCache, PackageCacheError
from agents.runtime.task_runner import RunOutcome, TaskRunner, TaskRunnerClosed
from fleet.engine import ready_queue
from fleet.engine.claims import Claim, claim_task, release_claim
from fleet.engine.context import build_task_context, encode_context
from fleet.engine.db_threads import DbThreadPool
from fleet.engine.events import ExecutionResult, ExecutionStatus, ExecutorMetrics, TaskReadyEvent
from fleet.engine.executor import TaskExecutor
from fleet.engine.results import Applied, TaskReport, result_handler
from fleet.models import Outcome, WorkflowExecution

log = logging.getLogger(__name__)

EXECUTOR_KEY = "default"
DEFAULT_CACHE_BYTES = 2 * 1024**3
# Capacity is one run per child, never more: a run claimed ahead would wait for a child
# while its result deadline (timeout + grace, set at the claim) ran down, and a long wait
# would get a live run declared lost.  Database threads are twice that, so recording
# finished runs never delays preparing the next ones.
DB_THREADS_PER_WORKER = 2
# Executions remembered for their package digest (it never changes for an execution).
DIGEST_MEMO_SIZE = 10_000
# On stop, in-flight runs get this long to finish before their children are killed.
# Shorter than serve's own stop timeout, so closing the children and connections still fits.
DRAIN_TIMEOUT_S = 20.0
# Recording an outcome survives a short database outage (the handler is idempotent).
APPLY_ATTEMPTS = 5
APPLY_RETRY_S = 0.5
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
            claim.task_execution_id, claim.assignment, Outcome.SUCCESS, output=outcome.output
        )
    return TaskReport(
        claim.task_execution_id,
        claim.assignment,
        _OUTCOME_BY_STATUS.get(outcome.status, Outcome.TIMEOUT),
        error_type=outcome.error_type,
        error_message=outcome.error_message,
        traceback=outcome.traceback,
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
    ) -> None:
        self.workers = workers
        self.claimer = claimer
        self.runner = TaskRunner(workers)
        self.cache = PackageCache(Path(cache_root), cache_bytes)
        self.drain_timeout_s = drain_timeout_s
        self._digests: OrderedDict[uuid.UUID, str] = OrderedDict()
        self._db: DbThreadPool | None = None
        self._holding = 0  # runs between claim and the child's answer: what uses a slot
        self._in_flight = 0  # runs anywhere in execute(), outcome recording included
        self._stopping = False
        self._lock = threading.Lock()
        self._executed = 0
        self._failed = 0
        self._total_duration_s = 0.0

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
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
        with self._lock:
            self._holding += 1
            self._in_flight += 1
        holding = True
        try:
            prepared = await self._db.call(self._prepare, event.task_execution_id)
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
            applied = await self._record(report_for(prepared.claim, outcome))
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

    def _prepare(self, task_execution_id: uuid.UUID) -> _Prepared | None:
        """Claim, then resolve package and context (database thread)."""
        claim = claim_task(task_execution_id, self.claimer)
        if claim is None:
            return None
        digest = ""
        try:
            digest = self._digest_of(claim.workflow_execution_id)
            context_json = encode_context(build_task_context(claim.task_execution_id))
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
            log.exception("preparing task %s failed", task_execution_id)
            return _Prepared(
                claim,
                error_type=type(exc).__name__,
                error_message=f"could not prepare the task: {exc}",
            )

    def _digest_of(self, workflow_execution_id: uuid.UUID) -> str:
        digest = self._digests.get(workflow_execution_id)
        if digest is None:
            digest = (
                WorkflowExecution.objects.filter(pk=workflow_execution_id)
                .values_list("package__digest", flat=True)
                .get()
            )
            with self._lock:
                self._digests[workflow_execution_id] = digest
                while len(self._digests) > DIGEST_MEMO_SIZE:
                    self._digests.popitem(last=False)
        return digest

    async def _run(self, prepared: _Prepared) -> RunOutcome | None:
        if prepared.error_type:
            return RunOutcome("failure", None, prepared.error_type, prepared.error_message)
        claim = prepared.claim
        try:
            outcome = await self.runner.run(
                prepared.package_dir, claim.function, prepared.context_json, claim.timeout_s
            )
        except TaskRunnerClosed:
            return None
        except Exception as exc:
            log.exception("running task %s failed in the runner", claim.task_execution_id)
            return RunOutcome("failure", None, "ExecutorError", f"the task runner failed: {exc}")
        finally:
            self.cache.unpin(prepared.digest)
        if outcome.error_type == "TaskRunnerClosed":
            return None
        return outcome

    async def _record(self, report: TaskReport) -> Applied:
        for attempt in range(1, APPLY_ATTEMPTS + 1):
            try:
                return await self._db.call(result_handler.apply, report)
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


def _load_blob(digest: str) -> bytes:
    from artifacts.services import load_blob

    return load_blob(digest)


def _describe(exc: BaseException) -> str:
    if type(exc).__name__ == "BlobNotFound":
        return "its bytes are missing from the artifact store"
    return str(exc) or type(exc).__name__
