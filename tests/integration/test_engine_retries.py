"""Retries: exponential backoff, the retry count, and timeouts that kill a run and retry it."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
from django.utils import timezone

from fleet.engine.events import ExecutionStatus
from fleet.models import TaskExecution, TaskOutcome
from tests.support.factories import finish, make_package, start, tasks_of
from tests.support.inprocess import drive, running_executor
from tests.support.loop import run_async

SOURCE = "def f(ctx):\n    return {}\n"


def fail(task):
    """Fail the task's current run; returns (Applied, the time window it was applied in)."""
    before = timezone.now()
    applied = finish(task, "failure", error_type="IOError", error_message="disk on fire")
    return applied, before, timezone.now()


def make_due(task) -> None:
    """Skip the backoff wait (the test checks the arithmetic, not the clock)."""
    TaskExecution.objects.filter(pk=task.pk).update(ready_at=timezone.now())


@pytest.mark.django_db
def test_retries_back_off_exponentially_then_fail(tenant):
    spec = {"id": "a", "function": "demo.steps:f", "retries": 3, "retry_backoff_s": 1.0}
    make_package(tenant, [spec], SOURCE)
    execution, tasks = start(tenant, "demo")
    task = tasks["a"]
    for attempt, delay_s in [(1, 1.0), (2, 2.0), (3, 4.0)]:
        applied, before, after = fail(task)
        assert applied.status == ExecutionStatus.RETRY
        assert applied.ready == []  # not due yet: the tick picks it up at ready_at
        task.refresh_from_db()
        assert (task.status, task.attempt) == ("Ready", attempt)
        # ready_at = now + backoff × 2^(attempt-1)
        assert before + timedelta(seconds=delay_s) <= task.ready_at
        assert task.ready_at <= after + timedelta(seconds=delay_s)
        assert applied.retry_at == task.ready_at
        assert task.wait_reason == f"retry {attempt + 1} of 4 after {delay_s:g}s"
        assert (task.error_type, task.error_message) == ("IOError", "disk on fire")
        make_due(task)
    applied, _, _ = fail(task)
    assert applied.status == ExecutionStatus.FAILED
    task.refresh_from_db()
    assert (task.status, task.attempt) == ("Failed", 4)
    attempts = (
        TaskOutcome.objects.filter(task_execution=task)
        .order_by("id")
        .values_list("attempt", flat=True)
    )
    assert list(attempts) == [1, 2, 3, 4]
    assert tasks_of(execution)["a"].workflow_execution.status == "Failed"


@pytest.mark.django_db
def test_a_retry_without_backoff_is_ready_at_once(tenant):
    make_package(tenant, [{"id": "a", "function": "demo.steps:f", "retries": 1}], SOURCE)
    _, tasks = start(tenant, "demo")
    applied, _, _ = fail(tasks["a"])
    assert applied.status == ExecutionStatus.RETRY
    assert [(e.task_name, e.attempt) for e in applied.ready] == [("a", 2)]


@pytest.mark.django_db
def test_a_success_after_a_retry_clears_the_error(tenant):
    make_package(tenant, [{"id": "a", "function": "demo.steps:f", "retries": 1}], SOURCE)
    execution, tasks = start(tenant, "demo")
    fail(tasks["a"])
    finish(tasks["a"], output={"ok": True})
    task = tasks_of(execution)["a"]
    assert (task.status, task.attempt, task.error_type, task.error_message) == (
        "Completed",
        2,
        "",
        "",
    )


SLOW = """
import os, pathlib, time

def slow(ctx):
    pathlib.Path(ctx["pids"]).open("a").write(f"{os.getpid()}\\n")
    marker = pathlib.Path(ctx["marker"])
    if ctx.get("always_slow") or not marker.exists():
        marker.touch()
        time.sleep(30)
    return {"finished": True}
"""


def timeout_package(tenant) -> None:
    spec = {"id": "slow", "function": "demo.steps:slow", "timeout_s": 0.5, "retries": 1}
    make_package(tenant, [spec], SLOW)


def history(task) -> list[tuple]:
    return list(
        TaskOutcome.objects.filter(task_execution=task)
        .order_by("id")
        .values_list("attempt", "outcome", "error_type", "error_message")
    )


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split()[2] == "Z"


@pytest.mark.django_db(transaction=True)
def test_a_task_past_its_timeout_is_killed_and_the_retry_succeeds(tenant, tmp_path):
    timeout_package(tenant)
    context = {"marker": str(tmp_path / "m"), "pids": str(tmp_path / "pids")}
    execution, _ = start(tenant, "demo", context)
    with running_executor(tmp_path / "cache") as (executor, sink):
        results = run_async(drive(executor, sink, execution.pk, timeout_s=15))
    assert [r.status for r in results] == [ExecutionStatus.RETRY, ExecutionStatus.COMPLETED]
    assert 0.5 <= results[0].duration_s < 2.0
    task = tasks_of(execution)["slow"]
    assert (task.status, task.attempt, task.output_context) == ("Completed", 2, {"finished": True})
    assert history(task) == [
        (1, "timeout", "TaskTimeout", "task exceeded its 0.5s timeout"),
        (2, "success", "", ""),
    ]
    first_pid, second_pid = map(int, (tmp_path / "pids").read_text().split())
    assert first_pid != second_pid and pid_gone(first_pid)


@pytest.mark.django_db(transaction=True)
def test_a_task_that_always_times_out_fails_after_its_retries(tenant, tmp_path):
    timeout_package(tenant)
    context = {"marker": str(tmp_path / "m"), "pids": str(tmp_path / "pids"), "always_slow": True}
    execution, _ = start(tenant, "demo", context)
    with running_executor(tmp_path / "cache") as (executor, sink):
        results = run_async(drive(executor, sink, execution.pk, timeout_s=15))
    assert [r.status for r in results] == [ExecutionStatus.RETRY, ExecutionStatus.FAILED]
    task = tasks_of(execution)["slow"]
    assert (task.status, task.attempt, task.error_type) == ("Failed", 2, "TaskTimeout")
    assert task.error_message == "task exceeded its 0.5s timeout"
    assert [h[1] for h in history(task)] == ["timeout", "timeout"]
    assert task.workflow_execution.status == "Failed"
