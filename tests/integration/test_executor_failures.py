"""Custom executors on a real database: ExecutionFailed is recorded by the task's retry policy
(never left Running, never crashing the dispatch), and every registered executor's
ExecutorMetrics are on /metrics, the fleet's real ones included."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest
from django.db import connection
from django.test import Client

from fleet.api import metrics as metrics_module
from fleet.engine.claims import claim_task
from fleet.engine.dispatcher import Dispatcher
from fleet.engine.events import (
    ExecutionFailed,
    ExecutionResult,
    ExecutionStatus,
    ExecutorMetrics,
    TaskReadyEvent,
)
from fleet.engine.executor import TaskExecutor
from fleet.engine.loop import EngineLoop
from fleet.executors.fleet import executor as fleet_executor_module
from fleet.executors.fleet.executor import FleetExecutor
from fleet.models import TaskExecution, TaskOutcome
from fleet.platform.config import get_config
from tests.support.agents import make_agent
from tests.support.factories import publish_example, ready_root, start, two_task_package
from tests.support.inprocess import drive, running_executor
from tests.support.loop import run_async

pytestmark = pytest.mark.django_db(transaction=True)

CLAIMER = "test-server"


class FailingExecutor(TaskExecutor):
    """Claims the task (or not) and raises ExecutionFailed, as a broken backend would."""

    def __init__(self, claim_first: bool = True, retryable: bool = True) -> None:
        self.claim_first = claim_first
        self.retryable = retryable
        self.raised = 0  # attempts run (claimed, then failed)
        self.stale = 0

    async def execute(self, event: TaskReadyEvent) -> ExecutionResult:
        if not self.claim_first:
            self.raised += 1
            raise ExecutionFailed("the backend is unreachable", error_type="BackendDown")
        claim = await asyncio.to_thread(in_thread, claim_task, event.task_execution_id, CLAIMER)
        if claim is None:  # a stale event (the poll saw the task Ready before its last run)
            self.stale += 1  # nothing to run, as every real executor answers it
            return ExecutionResult(event.task_execution_id, ExecutionStatus.SUPERSEDED)
        self.raised += 1
        raise ExecutionFailed(
            "the job was rejected by the cluster",
            assignment=claim.assignment,
            error_type="JobRejected",
            retryable=self.retryable,
        )

    def has_capacity(self) -> bool:
        return True

    def metrics(self) -> ExecutorMetrics:
        return ExecutorMetrics(max_concurrent=7, total_executed=self.raised)


def in_thread(fn, *args):
    """Run ``fn`` in a thread of its own with its own connection (as an executor's pool does)."""
    out = {}

    def target():
        try:
            out["value"] = fn(*args)
        finally:
            connection.close()

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    return out.get("value")


def dispatcher_with(executor: TaskExecutor, key: str = "custom") -> Dispatcher:
    dispatcher = Dispatcher(CLAIMER)
    dispatcher.register_executor(key, executor)
    dispatcher.configure(key)
    return dispatcher


def event_of(task) -> TaskReadyEvent:
    task.refresh_from_db()
    return TaskReadyEvent(task.pk, task.workflow_execution_id, task.task_name, task.attempt + 1)


def test_a_failure_after_the_claim_is_retried_then_failed_by_the_retry_policy(tenant):
    two_task_package(tenant, retries=1)
    execution, task = ready_root(tenant)
    dispatcher = dispatcher_with(FailingExecutor())

    first = run_async(dispatcher.dispatch(event_of(task)))
    assert (first.status, first.error) == (
        ExecutionStatus.RETRY,
        "the job was rejected by the cluster",
    )
    task.refresh_from_db()
    assert (task.status, task.attempt, task.error_type) == ("Ready", 1, "JobRejected")
    assert task.wait_reason == "retry 2 of 2 after 0s"
    assert task.error_message == "the job was rejected by the cluster"

    second = run_async(dispatcher.dispatch(event_of(task)))
    assert second.status == ExecutionStatus.FAILED
    task.refresh_from_db()
    execution.refresh_from_db()
    assert (task.status, task.attempt, execution.status) == ("Failed", 2, "Failed")
    outcomes = TaskOutcome.objects.filter(task_execution=task).order_by("id")
    assert [(o.attempt, o.outcome, o.applied, o.error_type) for o in outcomes] == [
        (1, "failure", True, "JobRejected"),
        (2, "failure", True, "JobRejected"),
    ]


def test_the_dispatch_loop_carries_on_and_the_retries_run_out(tenant):
    two_task_package(tenant, retries=2)  # retry_backoff_s 0: each retry is Ready at once
    execution, task = ready_root(tenant)
    executor = FailingExecutor()

    def failed() -> bool:
        return TaskExecution.objects.get(pk=task.pk).status == "Failed"

    async def scenario():
        loop = EngineLoop(dispatcher_with(executor), poll_s=0.05)
        await loop.start()
        try:
            for _ in range(500):  # in_thread: a connection of its own, closed after each look
                if await asyncio.to_thread(in_thread, failed):
                    return loop.stats
                await asyncio.sleep(0.02)
            raise AssertionError("the task did not fail within 10 s")
        finally:
            await loop.stop()

    stats = asyncio.run(scenario())
    assert executor.raised == 3  # the first attempt and both retries, then no more
    assert (stats["failed"], stats["errors"]) == (1, 0)  # handled, not a crash of the loop
    task.refresh_from_db()
    execution.refresh_from_db()
    assert (task.attempt, task.error_type, execution.status) == (3, "JobRejected", "Failed")


def test_a_failure_before_any_claim_is_an_attempt_too(tenant):
    two_task_package(tenant)  # no retries
    execution, task = ready_root(tenant)
    result = run_async(dispatcher_with(FailingExecutor(claim_first=False)).dispatch(event_of(task)))
    assert result.status == ExecutionStatus.FAILED
    task.refresh_from_db()
    assert (task.status, task.attempt, task.claimed_by) == ("Failed", 1, CLAIMER)
    assert (task.error_type, task.error_message) == ("BackendDown", "the backend is unreachable")
    execution.refresh_from_db()
    assert execution.status == "Failed"


def test_a_non_retryable_failure_fails_at_once_whatever_the_retries(tenant):
    two_task_package(tenant, retries=3)
    _, task = ready_root(tenant)
    executor = FailingExecutor(retryable=False)
    result = run_async(dispatcher_with(executor).dispatch(event_of(task)))
    assert result.status == ExecutionStatus.FAILED
    task.refresh_from_db()
    assert (task.status, task.attempt) == ("Failed", 1)


def test_a_failure_for_a_claim_not_ours_changes_nothing(tenant):
    two_task_package(tenant, retries=1)
    _, task = ready_root(tenant)
    other = claim_task(task.pk, "another-server")  # someone else runs it
    result = run_async(dispatcher_with(FailingExecutor(claim_first=False)).dispatch(event_of(task)))
    assert result.status == ExecutionStatus.SUPERSEDED
    task.refresh_from_db()
    assert (task.status, task.assignment, task.claimed_by) == (
        "Running",
        other.assignment,
        "another-server",
    )
    assert not TaskOutcome.objects.filter(task_execution=task).exists()


def scrape() -> str:
    return Client().get("/metrics").content.decode()


def sample(text: str, name: str, executor: str) -> float:
    match = re.search(rf'^{name}{{executor="{executor}"}} (\S+)$', text, re.MULTILINE)
    assert match, f"{name}{{executor={executor!r}}} not in /metrics"
    return float(match.group(1))


def test_every_registered_executor_is_on_metrics_labelled_by_key(tenant, tmp_path):
    publish_example(tenant)
    execution, _ = start(tenant, "etl", {"input_rows": [1, 2]})
    idle = FailingExecutor()
    with running_executor(tmp_path / "cache") as (executor, sink):
        dispatcher = Dispatcher(CLAIMER)
        dispatcher.register_executor("default", executor)
        dispatcher.register_executor("custom", idle)
        dispatcher.configure("default")
        metrics_module.watch_executors(dispatcher)
        try:
            run_async(drive(executor, sink, execution.pk))
            text = scrape()
        finally:
            metrics_module.watch_executors(None)
    assert sample(text, "cloacina_executor_tasks_executed_total", "default") == 4
    assert sample(text, "cloacina_executor_tasks_failed_total", "default") == 0
    assert sample(text, "cloacina_executor_capacity", "default") == 2
    assert sample(text, "cloacina_executor_active_tasks", "default") == 0
    assert sample(text, "cloacina_executor_avg_duration_ms", "default") > 0
    assert sample(text, "cloacina_executor_selected", "default") == 1
    assert sample(text, "cloacina_executor_capacity", "custom") == 7
    assert sample(text, "cloacina_executor_selected", "custom") == 0
    assert "cloacina_executor_capacity" not in scrape()  # nothing watched: no series


def test_the_fleet_executor_reports_its_real_capacity_and_runs(tenant, monkeypatch):
    monkeypatch.setattr(fleet_executor_module, "OUTCOME_RECHECK_S", 0.05)
    two_task_package(tenant, retries=1)
    make_agent(tenant, max_concurrency=3)
    make_agent(tenant, max_concurrency=2, in_flight=2)  # busy slots still count as capacity
    _, task = ready_root(tenant)
    ready = event_of(task)

    async def scenario():
        executor = FleetExecutor(claimer=CLAIMER, config=get_config())
        await executor.start()
        try:
            for _ in range(200):
                if executor.capacity.probed is not None:
                    break
                await asyncio.sleep(0.02)
            before = executor.metrics()
            running = asyncio.ensure_future(executor.execute(ready))
            # The agent never answers: past its result deadline the run is lost (a failure).
            while not await asyncio.to_thread(
                in_thread,
                lambda: TaskExecution.objects.filter(pk=task.pk, agent__isnull=False).update(
                    result_deadline="2000-01-01T00:00:00Z"
                ),
            ):
                await asyncio.sleep(0.01)
            result = await asyncio.wait_for(running, 5.0)
            return before, result, executor.metrics()
        finally:
            await executor.stop()

    before, result, after = run_async(scenario())
    assert (before.max_concurrent, before.total_executed, before.active_tasks) == (5, 0, 0)
    assert result.status == ExecutionStatus.RETRY
    assert (after.total_executed, after.total_failed, after.active_tasks) == (1, 1, 0)
    assert after.avg_duration_ms > 0
