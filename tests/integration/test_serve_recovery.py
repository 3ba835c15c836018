"""Recovery sweeps (lost runs, dead servers), server heartbeats and per-tick leadership."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest
from django.utils import timezone

from agents.models import Agent
from fleet.engine import leader, ready_queue, recovery, server_registry
from fleet.engine.claims import claim_task
from fleet.engine.executor import PeriodicJob
from fleet.engine.periodic import run_job_once
from fleet.models import DeliveryOutbox, ServerInstance, TaskExecution, TaskOutcome
from fleet.platform.advisory_locks import lock_id_for
from tests.support.factories import make_package, start

pytestmark = pytest.mark.django_db

SOURCE = "def f(ctx):\n    return {}\n"


@pytest.fixture
def submitted():
    events = []
    ready_queue.register(events.extend)
    yield events
    ready_queue.register(None)


def one_task(tenant, **fields) -> TaskExecution:
    make_package(tenant, [{"id": "a", "function": "demo.steps:f", **fields}], SOURCE)
    return start(tenant, "demo")[1]["a"]


def claimed(task: TaskExecution, claimer: str) -> TaskExecution:
    assert claim_task(task.pk, claimer) is not None
    task.refresh_from_db()
    return task


def overdue(task: TaskExecution) -> None:
    TaskExecution.objects.filter(pk=task.pk).update(
        result_deadline=timezone.now() - timedelta(seconds=1)
    )


def server(instance_id: str, silent_for_s: float = 0.0) -> ServerInstance:
    host, pid, _ = instance_id.split(":")
    return ServerInstance.objects.create(
        id=instance_id,
        host=host,
        pid=int(pid),
        default_executor="default",
        last_seen=timezone.now() - timedelta(seconds=silent_for_s),
    )


# --- lost runs ----------------------------------------------------------------------------


def test_a_run_past_its_deadline_is_lost_and_retried_by_its_policy(tenant, submitted):
    task = claimed(one_task(tenant, retries=1), "s:1:a")
    assert recovery.expire_lost_runs() == 0  # deadline still ahead
    overdue(task)
    assert recovery.expire_lost_runs() == 1
    task.refresh_from_db()
    assert (task.status, task.attempt, task.error_type) == ("Ready", 1, "ResultLost")
    assert [e.task_execution_id for e in submitted] == [task.pk]  # no backoff: offered at once
    outcome = TaskOutcome.objects.get(task_execution=task)
    assert (outcome.outcome, outcome.applied, outcome.assignment) == ("lost", True, 1)

    overdue(claimed(task, "s:1:a"))
    assert recovery.expire_lost_runs() == 1
    task.refresh_from_db()
    assert (task.status, task.attempt) == ("Failed", 2)
    assert recovery.expire_lost_runs() == 0  # nothing left: idempotent


# --- dead servers ---------------------------------------------------------------------------


def test_a_silent_servers_in_process_claims_go_back_to_ready(tenant, submitted, monkeypatch):
    monkeypatch.setenv("CLOACINA_SERVER_HEARTBEAT_S", "1")
    dead, alive = server("h:1:dead", silent_for_s=10), server("h:2:alive")
    make_package(
        tenant,
        [{"id": n, "function": "demo.steps:f"} for n in ("a", "b", "c")],
        SOURCE,
    )
    _, tasks = start(tenant, "demo")
    in_process = claimed(tasks["a"], dead.id)
    on_agent = claimed(tasks["b"], dead.id)
    elsewhere = claimed(tasks["c"], alive.id)
    agent = Agent.objects.create(tenant=tenant, name="ag", target_triple="x86_64-unknown-linux-gnu")
    DeliveryOutbox.objects.create(
        tenant=tenant,
        agent=agent,
        task_execution=on_agent,
        assignment=on_agent.assignment,
        payload={},
    )

    assert recovery.sweep_dead_servers() == [dead.id]

    for task in (in_process, on_agent, elsewhere):
        task.refresh_from_db()
    assert (in_process.status, in_process.attempt, in_process.claimed_by) == ("Ready", 0, "")
    assert in_process.assignment == 1  # stays bumped: a late outcome of the dead run is fenced
    assert "stopped heartbeating" in in_process.wait_reason
    assert on_agent.status == "Running"  # the agent has it; the fleet's sweeper owns that
    assert elsewhere.status == "Running"
    assert [(e.task_execution_id, e.attempt) for e in submitted] == [(in_process.pk, 1)]
    dead.refresh_from_db()
    alive.refresh_from_db()
    assert dead.stopped_at is not None and alive.stopped_at is None
    assert recovery.sweep_dead_servers() == []


def test_clean_shutdown_marks_stopped_and_releases_own_claims(tenant):
    me = server("h:3:me")
    task = claimed(one_task(tenant), me.id)
    assert recovery.shutdown_cleanup(me.id) == 1
    task.refresh_from_db()
    me.refresh_from_db()
    assert task.status == "Ready" and task.attempt == 0
    assert "shut down" in task.wait_reason
    assert me.stopped_at is not None


def test_a_server_presumed_dead_comes_back_on_its_next_beat():
    instance = server_registry.register_instance(server_registry.new_instance_id(), "default")
    before = instance.last_seen
    server_registry.mark_stopped(instance.id)
    server_registry.beat(instance.id)
    instance.refresh_from_db()
    assert instance.stopped_at is None and instance.last_seen > before


def test_heartbeat_interval_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("CLOACINA_SERVER_HEARTBEAT_S", "0.5")
    assert server_registry.dead_after_s() == 1.5
    monkeypatch.setenv("CLOACINA_SERVER_HEARTBEAT_S", "soon")
    with pytest.raises(ValueError, match="must be a number"):
        server_registry.heartbeat_interval_s()


# --- leadership -----------------------------------------------------------------------------


def test_only_the_lock_holder_runs_a_leader_only_job():
    calls = []
    job = PeriodicJob("test_leader_job", lambda: calls.append(1), 1.0, leader_only=True)
    other = leader.dedicated_connection()  # another "server" holding the job's lock
    try:
        other.execute("SELECT pg_advisory_lock(%s)", [lock_id_for(job.name)])
        assert run_job_once(job) is False and calls == []
        other.execute("SELECT pg_advisory_unlock(%s)", [lock_id_for(job.name)])
        assert run_job_once(job) is True and calls == [1]
        # Released after the tick: the other server can lead the next one.
        won = other.execute("SELECT pg_try_advisory_lock(%s)", [lock_id_for(job.name)])
        assert won.fetchone()[0] is True
    finally:
        other.close()
        leader.close_all()


def test_a_failing_job_is_logged_not_raised(caplog):
    def boom():
        raise RuntimeError("kaput")

    assert run_job_once(PeriodicJob("boom", boom, 1.0)) is False
    assert "periodic job boom failed" in caplog.text


def test_leader_connections_survive_a_dropped_session():
    lock = lock_id_for("test_drop")
    assert leader.run_as_leader(lock, lambda: None)
    conn = leader.lock_connection()
    with psycopg.connect(**_params()) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [conn.info.backend_pid])
    assert leader.run_as_leader(lock, lambda: None) is False  # this tick: nobody knows
    assert leader.run_as_leader(lock, lambda: None) is True  # next tick: a fresh connection
    leader.close_all()


def _params() -> dict:
    from django.db import connection

    params = connection.get_connection_params()
    for key in ("cursor_factory", "context", "prepare_threshold"):
        params.pop(key, None)
    return {**params, "autocommit": True}
