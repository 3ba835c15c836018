"""The FleetExecutor on its own: placement outcomes, the rendezvous (local and by NOTIFY),
the result-wait deadline, and the capacity hint — no agent process needed."""

from __future__ import annotations

import asyncio
import threading

import pytest
from django.db import connection

from fleet.engine.events import ExecutionStatus, TaskReadyEvent
from fleet.engine.results import TaskReport, result_handler
from fleet.executors.fleet import executor as fleet_executor_module
from fleet.executors.fleet.delivery import rendezvous as rendezvous_module
from fleet.executors.fleet.executor import FleetExecutor
from fleet.models import DeliveryOutbox, TaskExecution
from fleet.platform.config import get_config
from tests.support.agents import make_agent
from tests.support.factories import ready_root, two_task_package
from tests.support.loop import run_async

pytestmark = pytest.mark.django_db(transaction=True)


def event(task) -> TaskReadyEvent:
    return TaskReadyEvent(task.pk, task.workflow_execution_id, task.task_name, task.attempt + 1)


def in_thread(fn, *args):
    """Run ``fn`` as another process would: its own thread and connection."""
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


async def started_executor() -> FleetExecutor:
    executor = FleetExecutor(claimer="test-server", config=get_config())
    await executor.start()
    return executor


def test_no_agent_is_requeued_without_using_an_attempt(tenant):
    two_task_package(tenant)
    _, task = ready_root(tenant)

    async def scenario():
        executor = await started_executor()
        try:
            return await executor.execute(event(task))
        finally:
            await executor.stop()

    result = run_async(scenario())
    assert (result.status, result.error) == (
        ExecutionStatus.REQUEUED,
        "no live agent in tenant acme",
    )
    task.refresh_from_db()
    assert (task.status, task.attempt, task.wait_reason) == (
        "Ready",
        0,
        "no live agent in tenant acme",
    )


def _offered_again(task, monkeypatch, placements: int, wait_s: float) -> list[tuple]:
    """``placements`` placements of ``task`` in a row on a started executor, each followed
    by ``wait_s``: per placement (its status, its error, the events offered again so far)."""
    offered: list = []
    monkeypatch.setattr(fleet_executor_module.ready_queue, "submit", offered.extend)

    async def scenario():
        executor = await started_executor()
        try:
            seen = []
            for _ in range(placements):
                result = await executor.execute(event(task))
                await asyncio.sleep(wait_s)
                seen.append((result.status, result.error, list(offered)))
            return seen
        finally:
            await executor.stop()

    return run_async(scenario())


def test_a_task_no_slot_was_found_for_is_offered_again_once_in_a_row(tenant, monkeypatch):
    """Not left to the dispatch loop's tick (a second or more): offered again shortly after
    its placement found no slot; after a second miss in a row, left to the tick."""
    two_task_package(tenant)
    _, task = ready_root(tenant)
    wait_s = fleet_executor_module.REOFFER_AFTER_S * 4
    # The first placement, then the re-offer, missing again.
    (first, _, after_first), (second, _, after_second) = _offered_again(
        task, monkeypatch, 2, wait_s
    )
    assert (first, second) == (ExecutionStatus.REQUEUED, ExecutionStatus.REQUEUED)
    assert after_first == [event(task)]
    assert after_second == [event(task)]  # not again: the tick takes it from here


def test_a_task_whose_tenants_agents_are_busy_is_offered_again_twice_in_a_row(tenant, monkeypatch):
    """Its agents are there but every slot is taken: one frees within a run's time, so a
    second miss is offered again too (not left to the tick, a second later); a third is
    left to the tick."""
    two_task_package(tenant)
    make_agent(tenant, max_concurrency=1, in_flight=1)
    _, task = ready_root(tenant)
    wait_s = fleet_executor_module.REOFFER_BUSY_AFTER_S * 2
    # The first placement, then its two re-offers.
    seen = _offered_again(task, monkeypatch, 3, wait_s)
    busy = "the 1 live agent is at capacity"
    assert [(status, error, len(offered)) for status, error, offered in seen] == [
        (ExecutionStatus.REQUEUED, busy, 1),
        (ExecutionStatus.REQUEUED, busy, 2),
        (ExecutionStatus.REQUEUED, busy, 2),  # not again: the tick takes it from here
    ]


def test_an_outcome_applied_by_another_process_wakes_the_waiter_by_notify(tenant):
    two_task_package(tenant)
    agent = make_agent(tenant)
    _, task = ready_root(tenant)

    def other_process_reports():
        row = DeliveryOutbox.objects.get(task_execution=task)
        applied = result_handler.apply(
            TaskReport(task.pk, row.assignment, "success", output={"a": 1}, agent_id=agent.id)
        )
        with connection.cursor() as cursor:  # what announce() does when no waiter is local
            cursor.execute(
                "SELECT pg_notify('task_outcome', %s)",
                [f"{task.pk}:{row.assignment}:{applied.status.value}"],
            )

    async def scenario():
        executor = await started_executor()
        try:
            running = asyncio.ensure_future(executor.execute(event(task)))
            while not await asyncio.to_thread(
                in_thread, lambda: DeliveryOutbox.objects.filter(task_execution=task).exists()
            ):
                await asyncio.sleep(0.01)
            assert not running.done()
            await asyncio.to_thread(in_thread, other_process_reports)
            return await asyncio.wait_for(running, 2.0)  # far less than the 5 s re-check
        finally:
            await executor.stop()

    result = run_async(scenario())
    assert result.status == ExecutionStatus.COMPLETED
    task.refresh_from_db()
    assert task.status == "Completed"


def test_a_run_past_its_result_deadline_is_declared_lost(tenant, monkeypatch):
    monkeypatch.setattr(fleet_executor_module, "OUTCOME_RECHECK_S", 0.05)
    two_task_package(tenant, retries=1)
    make_agent(tenant)
    _, task = ready_root(tenant)

    async def scenario():
        executor = await started_executor()
        try:
            running = asyncio.ensure_future(executor.execute(event(task)))
            while not await asyncio.to_thread(
                in_thread,
                lambda: TaskExecution.objects.filter(pk=task.pk, agent__isnull=False).update(
                    result_deadline="2000-01-01T00:00:00Z"
                ),
            ):
                await asyncio.sleep(0.01)
            return await asyncio.wait_for(running, 5.0)
        finally:
            await executor.stop()

    result = run_async(scenario())
    assert result.status == ExecutionStatus.RETRY
    task.refresh_from_db()
    assert (task.status, task.error_type, task.attempt) == ("Ready", "ResultLost", 1)


def test_has_capacity_follows_the_free_slots(tenant):
    agent = make_agent(tenant, max_concurrency=2)

    async def scenario():
        executor = await started_executor()
        try:
            for _ in range(100):
                if executor.capacity.probed is not None:
                    break
                await asyncio.sleep(0.02)
            seen = [executor.capacity.probed, executor.has_capacity()]
            await asyncio.to_thread(
                in_thread, lambda: type(agent).objects.filter(pk=agent.pk).update(in_flight=2)
            )
            await asyncio.sleep(0.4)
            seen += [executor.capacity.probed, executor.has_capacity()]
            return seen
        finally:
            await executor.stop()

    assert run_async(scenario()) == [2, True, 0, False]


def test_the_rendezvous_ignores_another_assignment():
    async def scenario():
        rv = rendezvous_module.Rendezvous()
        future = rv.register("t", assignment=3)
        rv.on_notify("not-a-uuid:1:Completed")
        assert rv.wake("t", rendezvous_module.Outcome(2, ExecutionStatus.COMPLETED)) is False
        assert rv.wake("t", rendezvous_module.Outcome(3, ExecutionStatus.FAILED)) is True
        return await asyncio.wait_for(future, 1)

    assert run_async(scenario()).status == ExecutionStatus.FAILED
