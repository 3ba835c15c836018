"""A lone root task placed by the transaction that starts its execution
(fleet/executors/fleet/delivery/one_trip.py ``root_placement``, fleet/engine/scheduler.py
``RootPlacement``): one round trip and one synchronous commit for the start and the
placement together, and the usual path for everything else."""

from __future__ import annotations

import pytest

from agents.models import Agent
from fleet.engine import ready_queue, scheduler
from fleet.engine.db_threads import use_prepared_statements
from fleet.executors.fleet.delivery import local_sockets, one_trip
from fleet.executors.fleet.delivery.placement import Delivered, Placed
from fleet.executors.fleet.delivery.relay import Relay
from fleet.models import DeliveryOutbox, TaskExecution, WorkflowExecution
from tests.support.agents import make_agent
from tests.support.factories import make_package
from tests.support.loop import run_async
from tests.support.round_trips import RoundTrips

pytestmark = pytest.mark.django_db(transaction=True)

SOURCE = "def noop(context):\n    return None\n"


@pytest.fixture
def fleet_here():
    """A fleet executor runs in this process (it names ``server-1``) and its dispatch loop
    takes events (``waiting`` of them wait in it)."""
    waiting = [0]
    events: list = []
    one_trip.place_at_start("server-1")
    ready_queue.register(events.extend, lambda: waiting[0])
    yield waiting
    ready_queue.register(None)
    one_trip.place_at_start(None)


def start(tenant, context=None, tasks=None, workflow="lone", traced: list | None = None):
    """Start an execution of a new package (``traced``: the start's round trips, on a
    connection that binds on the server and prepares, as the delivery pool's threads do)."""
    tasks = tasks or [{"id": "t0", "function": "demo.steps:noop"}]
    package = make_package(tenant, tasks, SOURCE, name=workflow, workflow=workflow)
    use_prepared_statements("test-start-placement")
    with RoundTrips() as trace:
        started = scheduler.start_execution_with_roots(
            tenant, workflow, context or {}, package=package, place_root=one_trip.root_placement
        )
    if traced is not None:
        traced.extend(trace.trips())
    return started


def _ready_and_alone(execution, roots) -> None:
    assert [root.placed for root in roots] == [None] * len(roots)
    for root in roots:
        task = TaskExecution.objects.get(pk=root.task_execution_id)
        assert (task.status, task.assignment, task.agent_id) == ("Ready", 0, None)
    assert not DeliveryOutbox.objects.filter(task_execution__workflow_execution=execution).exists()
    assert WorkflowExecution.objects.get(pk=execution.pk).status == "Pending"


def test_a_lone_root_is_placed_by_its_start_in_one_round_trip(tenant, fleet_here):
    agent = make_agent(tenant, "here", max_concurrency=4)
    trips: list = []
    execution, (root,) = start(tenant, {"k": "v"}, traced=trips)
    assert len(trips) == 1, trips  # BEGIN, the insert, the placement, COMMIT, one Sync
    assert trips[0].count("Execute") == 4 and trips[0].count("Sync") == 1
    placed = root.placed
    assert isinstance(placed, Delivered) and placed.agent_id == agent.pk
    assert placed.packet["context_json"] == '{"k":"v"}'
    task = TaskExecution.objects.get(pk=root.task_execution_id)
    assert (task.status, task.assignment, task.agent_id, task.claimed_by) == (
        "Running", placed.assignment, agent.pk, "server-1")  # fmt: skip
    assert task.result_deadline is not None
    row = DeliveryOutbox.objects.get(task_execution_id=task.pk)
    assert (row.pk, row.state, row.attempts) == (placed.outbox_id, "delivered", 1)
    assert WorkflowExecution.objects.get(pk=execution.pk).status == "Running"
    assert Agent.objects.get(pk=agent.pk).in_flight == 1


def test_the_start_commits_synchronously():
    """The placement's own statement relaxes its commit; inside the start it must not: the
    201 of a start is only sent once the execution is durable."""
    assert "synchronous_commit" in one_trip._STATEMENT
    assert "synchronous_commit" not in one_trip._IN_START


def test_an_agent_of_another_server_gets_a_pending_row(tenant, fleet_here):
    agent = make_agent(tenant, "remote", connected="another-server")
    _execution, (root,) = start(tenant)
    assert type(root.placed) is Placed and root.placed.agent_id == agent.pk
    row = DeliveryOutbox.objects.get(task_execution_id=root.task_execution_id)
    assert (row.state, row.attempts) == ("pending", 0)  # its server's relay gets the NOTIFY


def test_no_idle_agent_leaves_the_root_ready(tenant, fleet_here):
    make_agent(tenant, "full", max_concurrency=1, in_flight=1)
    _ready_and_alone(*start(tenant))
    assert Agent.objects.get(name="full").in_flight == 1


@pytest.mark.parametrize(
    "context,extra",
    [({"f": 1.5}, {}), ({}, {"agent": "here"})],
    ids=["float-context", "selector"],
)
def test_a_root_the_statement_cannot_build_goes_the_usual_way(tenant, fleet_here, context, extra):
    make_agent(tenant, "here", max_concurrency=4)
    tasks = [{"id": "t0", "function": "demo.steps:noop", **extra}]
    _ready_and_alone(*start(tenant, context, tasks))


def test_several_roots_go_the_usual_way(tenant, fleet_here):
    make_agent(tenant, "here", max_concurrency=4)
    tasks = [{"id": f"t{i}", "function": "demo.steps:noop"} for i in range(2)]
    _ready_and_alone(*start(tenant, tasks=tasks))


def test_tasks_waiting_in_the_dispatch_loop_keep_their_turn(tenant, fleet_here):
    make_agent(tenant, "here", max_concurrency=4)
    fleet_here[0] = 1
    _ready_and_alone(*start(tenant))


def test_while_another_start_places_its_root_this_one_goes_the_usual_way(tenant, fleet_here):
    make_agent(tenant, "here", max_concurrency=4)
    assert scheduler._placing.acquire(blocking=False)  # another start is placing right now
    try:
        _ready_and_alone(*start(tenant))
    finally:
        scheduler._placing.release()
    _execution, (root,) = start(tenant, workflow="next")
    assert isinstance(root.placed, Delivered)


def test_without_a_fleet_executor_here_nothing_is_placed(tenant, fleet_here):
    make_agent(tenant, "here", max_concurrency=4)
    one_trip.place_at_start(None)
    _ready_and_alone(*start(tenant))


def test_a_failed_placement_still_starts_the_execution_alone(tenant, fleet_here, monkeypatch):
    make_agent(tenant, "here", max_concurrency=4)
    monkeypatch.setattr(one_trip, "_IN_START", "SELECT no_such_column FROM fleet_tenant")
    execution, roots = start(tenant)
    _ready_and_alone(execution, roots)


def test_a_socket_gone_after_the_commit_is_delivered_exactly_once(tenant, fleet_here):
    """The root was placed as delivered to a socket of this process, which closed between
    the commit and the push: the row goes back to pending, and once the agent's socket is
    back the relay pushes it, once."""
    agent = make_agent(tenant, "here", max_concurrency=4)
    _execution, (root,) = start(tenant)
    placed = root.placed
    assert isinstance(placed, Delivered)
    written: list = []
    local_sockets.clear()
    try:
        assert run_async(_push(placed)) is False  # no socket here any more
        row = DeliveryOutbox.objects.get(task_execution_id=root.task_execution_id)
        assert (row.pk, row.state) == (placed.outbox_id, "pending")

        local_sockets.register(local_sockets.LocalSocket(
            agent.pk, tenant.pk, "test.back", 1, "json", None, _recorder(written), _recorder([])
        ))  # fmt: skip
        assert run_async(_relay_rounds(2)) == 1
    finally:
        local_sockets.clear()
    assert [p["task_execution_id"] for p in written] == [str(root.task_execution_id)]
    rows = list(DeliveryOutbox.objects.filter(task_execution_id=root.task_execution_id))
    assert [(r.pk, r.state, r.assignment) for r in rows] == [
        (placed.outbox_id, "delivered", placed.assignment)
    ]


def _recorder(into: list):
    async def record(*args) -> None:
        into.append(args[0])

    return record


async def _push(placed: Delivered) -> bool:
    relay = Relay(poll_s=600)
    try:
        return await relay.push_delivered(
            placed.agent_id, placed.outbox_id, placed.packet, placed.waited_s
        )
    finally:
        await relay.stop()


async def _relay_rounds(rounds: int) -> int:
    relay = Relay(poll_s=600)
    relay._last_reconcile = float("inf")  # rounds only take rows: no roster check here
    try:
        return sum([await relay.run_once() for _ in range(rounds)])
    finally:
        await relay.stop()
