"""The in-process executor end to end: real package, real child processes, real PostgreSQL."""

from __future__ import annotations

import asyncio
import time

import pytest

from artifacts.models import ArtifactBlob
from fleet.engine.events import ExecutionStatus
from fleet.models import TaskOutcome, WorkflowExecution
from tests.support.factories import make_package, publish_example, start, tasks_of
from tests.support.inprocess import drive, initial_events, running_executor
from tests.support.loop import run_async

pytestmark = pytest.mark.django_db(transaction=True)

EXPECTED_ETL_CONTEXT = {
    "input_rows": [4, 5, 6],
    "rows": [4, 5, 6],
    "sum": 15,
    "max": 6,
    "loaded": True,
    "report": "loaded 3 rows: sum=15 max=6",
}


def reload(execution) -> WorkflowExecution:
    return WorkflowExecution.objects.get(pk=execution.pk)


def test_it_runs_the_example_diamond_to_completed(tenant, tmp_path):
    publish_example(tenant)
    execution, _ = start(tenant, "etl", {"input_rows": [4, 5, 6]})
    with running_executor(tmp_path / "cache") as (executor, sink):
        results = run_async(drive(executor, sink, execution.pk))
        metrics = executor.metrics()
    assert [r.status for r in results] == [ExecutionStatus.COMPLETED] * 4
    # extract's success made both transforms Ready; the second transform made load Ready.
    assert sorted(e.task_name for e in sink.seen) == ["load", "transform_a", "transform_b"]
    execution = reload(execution)
    assert execution.status == "Completed"
    assert execution.final_context == EXPECTED_ETL_CONTEXT
    tasks = tasks_of(execution)
    assert {t: (r.status, r.attempt) for t, r in tasks.items()} == {
        "extract": ("Completed", 1),
        "transform_a": ("Completed", 1),
        "transform_b": ("Completed", 1),
        "load": ("Completed", 1),
    }
    assert tasks["transform_a"].output_context == {"sum": 15}
    assert all(t.claimed_by == "test-server" and t.agent_id is None for t in tasks.values())
    assert (metrics.total_executed, metrics.total_failed, metrics.max_concurrent) == (4, 0, 2)
    assert metrics.extra["cache_misses"] == 1  # one package fetch for four tasks


def test_the_fail_once_path_retries_and_succeeds(tenant, tmp_path):
    publish_example(tenant)
    marker = tmp_path / "extract-failed-once"
    context = {"fail_once": True, "marker_path": str(marker), "input_rows": [4, 5, 6]}
    execution, _ = start(tenant, "etl", context)
    with running_executor(tmp_path / "cache") as (executor, sink):
        results = run_async(drive(executor, sink, execution.pk))
    assert results[0].status == ExecutionStatus.RETRY
    assert "simulated transient failure" in results[0].error
    assert marker.exists()
    execution = reload(execution)
    assert execution.status == "Completed"
    assert execution.final_context == {**context, **EXPECTED_ETL_CONTEXT}
    extract = tasks_of(execution)["extract"]
    assert (extract.attempt, extract.status, extract.error_type) == (2, "Completed", "")
    history = list(
        TaskOutcome.objects.filter(task_execution=extract)
        .order_by("id")
        .values_list("attempt", "outcome", "error_type", "applied")
    )
    assert history == [
        (1, "failure", "TransientExtractError", True),
        (2, "success", "", True),
    ]


def test_a_missing_package_blob_fails_the_task_instead_of_leaving_it_running(tenant, tmp_path):
    package = make_package(
        tenant, [{"id": "a", "function": "demo.steps:a"}], "def a(ctx):\n    return {}\n"
    )
    ArtifactBlob.objects.filter(digest=package.digest).delete()
    execution, _ = start(tenant, "demo")
    with running_executor(tmp_path / "cache") as (executor, sink):
        results = run_async(drive(executor, sink, execution.pk))
    assert [r.status for r in results] == [ExecutionStatus.FAILED]
    task = tasks_of(execution)["a"]
    assert (task.status, task.attempt, task.error_type) == ("Failed", 1, "PackageUnavailable")
    assert task.error_message == (
        f"package {package.digest} could not be loaded: "
        "its bytes are missing from the artifact store"
    )
    assert reload(execution).status == "Failed"


def test_a_task_offered_twice_runs_once(tenant, tmp_path):
    make_package(tenant, [{"id": "a", "function": "demo.steps:a"}], RUN_COUNTER)
    counter = tmp_path / "runs"
    execution, _ = start(tenant, "demo", {"counter": str(counter)})
    event = initial_events(execution.pk)[0]
    with running_executor(tmp_path / "cache") as (executor, _sink):

        async def twice():
            return await asyncio.gather(executor.execute(event), executor.execute(event))

        results = run_async(twice())
    assert sorted(r.status.value for r in results) == ["Completed", "Superseded"]
    assert counter.read_text() == "x"


RUN_COUNTER = """
import time

def a(ctx):
    with open(ctx["counter"], "a") as fh:
        fh.write("x")
    time.sleep(ctx.get("sleep_s", 0))
    return {"ran": True}
"""


def test_capacity_is_one_run_per_worker(tenant, tmp_path):
    make_package(tenant, [{"id": "a", "function": "demo.steps:a"}], RUN_COUNTER)
    execution, _ = start(tenant, "demo", {"counter": str(tmp_path / "c"), "sleep_s": 0.5})
    event = initial_events(execution.pk)[0]
    with running_executor(tmp_path / "cache", workers=1) as (executor, _sink):

        async def scenario():
            idle = executor.has_capacity()
            run = asyncio.ensure_future(executor.execute(event))
            await asyncio.sleep(0.25)
            busy = (executor.has_capacity(), executor.metrics().active_tasks)
            result = await run
            return idle, busy, result, executor.has_capacity()

        idle, busy, result, after = run_async(scenario())
    assert idle is True
    assert busy == (False, 1)
    assert result.status == ExecutionStatus.COMPLETED and result.duration_s >= 0.5
    assert after is True


def test_stop_lets_a_running_task_finish(tenant, tmp_path):
    make_package(tenant, [{"id": "a", "function": "demo.steps:a"}], RUN_COUNTER)
    execution, _ = start(tenant, "demo", {"counter": str(tmp_path / "c"), "sleep_s": 0.4})
    event = initial_events(execution.pk)[0]
    with running_executor(tmp_path / "cache", workers=1) as (executor, _sink):

        async def scenario():
            run = asyncio.ensure_future(executor.execute(event))
            await asyncio.sleep(0.15)
            started = time.monotonic()
            await executor.stop()
            return await run, time.monotonic() - started, executor.has_capacity()

        result, waited, capacity = run_async(scenario())
    assert result.status == ExecutionStatus.COMPLETED
    assert waited >= 0.2 and capacity is False
    assert tasks_of(execution)["a"].status == "Completed"


def test_the_runner_is_not_a_fork_of_the_server(tenant, tmp_path):
    source = "import os, sys\n\ndef a(ctx):\n    return {'pid': os.getpid(), 'argv': sys.argv}\n"
    make_package(tenant, [{"id": "a", "function": "demo.steps:a"}], source)
    execution, _ = start(tenant, "demo")
    with running_executor(tmp_path / "cache") as (executor, sink):
        run_async(drive(executor, sink, execution.pk))
        pids = executor.runner.child_pids()
    output = tasks_of(execution)["a"].output_context
    assert output["pid"] in pids
    assert output["argv"][0].endswith("agents/sandbox/task_child.py")


def test_a_run_cut_short_by_stop_is_given_back_without_using_an_attempt(tenant, tmp_path):
    make_package(tenant, [{"id": "a", "function": "demo.steps:a"}], RUN_COUNTER)
    execution, _ = start(tenant, "demo", {"counter": str(tmp_path / "c"), "sleep_s": 30})
    event = initial_events(execution.pk)[0]
    with running_executor(tmp_path / "cache", workers=1, drain_timeout_s=0.3) as (executor, _):

        async def scenario():
            run = asyncio.ensure_future(executor.execute(event))
            await asyncio.sleep(0.3)
            await executor.stop()
            return await run

        result = run_async(scenario())
    assert result.status == ExecutionStatus.REQUEUED
    task = tasks_of(execution)["a"]
    assert (task.status, task.attempt, task.assignment) == ("Ready", 0, 1)
    assert task.wait_reason == "the server stopped before the task finished"
    assert not TaskOutcome.objects.filter(task_execution=task).exists()
