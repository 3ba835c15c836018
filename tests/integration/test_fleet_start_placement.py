"""A REST start places its lone root task in its own transaction
(fleet/executors/fleet/delivery/start_placement.py, the engine's start hook in
fleet/engine/hooks.py, ``scheduler.start_active``): one round trip and one synchronous commit
for the start and the placement, only onto an agent of this process, and the usual path for
everything else."""

from __future__ import annotations

import pytest
from django.db import connection

from agents.models import Agent
from fleet.engine import hooks, scheduler
from fleet.engine.db_threads import use_prepared_statements
from fleet.executors.fleet.delivery import local_sockets
from fleet.executors.fleet.delivery.placement import Delivered
from fleet.executors.fleet.delivery.redelivery import redeliver_unreceived
from fleet.executors.fleet.delivery.relay import Relay
from fleet.executors.fleet.delivery.start_placement import StartPlacer
from fleet.models import DeliveryOutbox, TaskExecution, WorkflowExecution
from tests.support.agents import make_agent
from tests.support.factories import make_package
from tests.support.loop import run_async
from tests.support.round_trips import RoundTrips

pytestmark = pytest.mark.django_db(transaction=True)

SOURCE = "def noop(context):\n    return None\n"
ONE = [{"id": "t0", "function": "demo.steps:noop"}]


@pytest.fixture
def placer():
    """The fleet executor's start hook, as ``FleetExecutor.start`` registers it."""
    room = [True]
    hook = StartPlacer(local_sockets.server_id(), lambda: room[0])
    hook.room = room
    hooks.register_start_hook(hook)
    yield hook
    hooks.register_start_hook(None)
    local_sockets.clear()


def socket_of(agent, written: list | None = None) -> None:
    """A socket of ``agent`` held by this process (what it is pushed is appended to ``written``)."""

    async def push(packet: dict) -> None:
        if written is not None:
            written.append(packet)

    async def close(code: int, reason: str) -> None:
        return None

    local_sockets.register(local_sockets.LocalSocket(
        agent.pk, agent.tenant_id, f"test.{agent.name}", 1, "json", None, push, close
    ))  # fmt: skip


def start(tenant, context=None, tasks=None, workflow="lone", traced: list | None = None):
    """``start_active`` of a new package's workflow, on a connection that binds on the
    server and prepares, as the delivery pool's threads (the REST start's) do."""
    make_package(tenant, tasks or ONE, SOURCE, name=workflow, workflow=workflow)
    use_prepared_statements("test-start-placement")
    with RoundTrips() as trace:
        started = scheduler.start_active(tenant.pk, workflow, context or {})
    if traced is not None:
        traced.extend(trace.trips())
    assert started is not None
    return started


def _ready_and_alone(execution_id, roots) -> None:
    """Nothing was placed: every root Ready, no outbox row, the execution Pending."""
    assert [root.placed for root in roots] == [None] * len(roots)
    for root in roots:
        task = TaskExecution.objects.get(pk=root.task_execution_id)
        assert (task.status, task.assignment, task.agent_id) == ("Ready", 0, None)
    assert not DeliveryOutbox.objects.filter(
        task_execution__workflow_execution_id=execution_id
    ).exists()
    assert WorkflowExecution.objects.get(pk=execution_id).status == "Pending"


def _xmin(table: str, pk) -> str:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT xmin::text FROM {table} WHERE id = %s", [pk])
        return cursor.fetchone()[0]


def test_a_lone_root_is_placed_by_its_start_in_one_round_trip(tenant, placer):
    agent = make_agent(tenant, "here", max_concurrency=4)
    socket_of(agent)
    trips: list = []
    execution_id, (root,) = start(tenant, {"k": "v"}, traced=trips)
    # BEGIN, the insert, the placement, the synchronous commit restored, COMMIT: one Sync.
    assert len(trips) == 1, trips
    assert trips[0].count("Execute") == 5 and trips[0].count("Sync") == 1
    placed = root.placed
    assert isinstance(placed, Delivered) and placed.agent_id == agent.pk
    assert placed.packet["context_json"] == '{"k":"v"}'
    assert placer.placed == 1
    task = TaskExecution.objects.get(pk=root.task_execution_id)
    assert (task.status, task.attempt, task.assignment, task.agent_id, task.claimed_by) == (
        "Running", 1, placed.assignment, agent.pk, local_sockets.server_id())  # fmt: skip
    assert task.result_deadline is not None
    row = DeliveryOutbox.objects.get(task_execution_id=task.pk)
    assert (row.pk, row.state, row.attempts) == (placed.outbox_id, "delivered", 1)
    assert placed.packet == {**row.payload, "outbox_id": row.pk}
    assert WorkflowExecution.objects.get(pk=execution_id).status == "Running"
    assert Agent.objects.get(pk=agent.pk).in_flight == 1
    # One transaction wrote the execution, claimed the task and wrote its packet.
    assert (
        _xmin("fleet_workflowexecution", execution_id)
        == _xmin("fleet_taskexecution", task.pk)
        == _xmin("delivery_outbox", row.pk)
    )


def test_the_start_commits_synchronously(tenant, placer):
    """The placement statement relaxes its transaction's commit, as every placement does;
    in the start's transaction the setting is restored before the COMMIT: a start's 201 is
    sent only once the execution is durable."""
    socket_of(make_agent(tenant, "here", max_concurrency=4))
    make_package(tenant, ONE, SOURCE, name="lone", workflow="lone")
    with RoundTrips() as trace:
        _execution_id, (root,) = scheduler.start_active(tenant.pk, "lone", {})
    assert isinstance(root.placed, Delivered)
    sent = "\n".join("\t".join(fields) for fields in trace.lines)
    relax = sent.index("set_config('synchronous_commit', 'off', true)")
    assert sent.count("'synchronous_commit', 'off'") == 1
    assert relax < sent.index('"SET LOCAL synchronous_commit TO DEFAULT"') < sent.index('"COMMIT"')


def test_an_agent_of_another_server_is_left_to_the_usual_path(tenant, placer):
    """Its packet would be pushed by that server: the root goes the usual way (which
    writes it pending for that server's relay), although a free slot is there."""
    make_agent(tenant, "remote", connected="another-server", max_concurrency=4)
    socket_of(make_agent(tenant, "here-but-full", max_concurrency=1, in_flight=1))
    _ready_and_alone(*start(tenant))
    assert Agent.objects.get(name="remote").in_flight == 0


def test_no_free_slot_leaves_the_root_ready(tenant, placer):
    agent = make_agent(tenant, "full", max_concurrency=1, in_flight=1)
    socket_of(agent)
    _ready_and_alone(*start(tenant))
    assert Agent.objects.get(pk=agent.pk).in_flight == 1


@pytest.mark.parametrize(
    "context,extra",
    [({"f": 1.5}, {}), ({"o": {"x": 1}}, {}), ({}, {"agent": "here"})],
    ids=["float-context", "nested-context", "selector"],
)
def test_a_root_the_statement_cannot_build_goes_the_usual_way(tenant, placer, context, extra):
    socket_of(make_agent(tenant, "here", max_concurrency=4))
    _ready_and_alone(*start(tenant, context, [{**ONE[0], **extra}]))


def test_several_roots_go_the_usual_way(tenant, placer):
    socket_of(make_agent(tenant, "here", max_concurrency=4))
    tasks = [{"id": f"t{i}", "function": "demo.steps:noop"} for i in range(2)]
    _ready_and_alone(*start(tenant, tasks=tasks))


def test_a_lone_root_with_dependents_is_placed(tenant, placer):
    socket_of(make_agent(tenant, "here", max_concurrency=4))
    tasks = [ONE[0], {"id": "t1", "function": "demo.steps:noop", "dependencies": ["t0"]}]
    _execution_id, (root,) = start(tenant, tasks=tasks)
    assert isinstance(root.placed, Delivered)
    assert TaskExecution.objects.get(task_name="t1").status == "NotStarted"


def test_no_room_or_no_socket_here_asks_nothing(tenant, placer):
    agent = make_agent(tenant, "here", max_concurrency=4)
    _ready_and_alone(*start(tenant))  # no socket in this process
    socket_of(agent)
    placer.room[0] = False  # the executor sees no free slot
    trips: list = []
    _ready_and_alone(*start(tenant, workflow="second", traced=trips))
    assert trips[0].count("Execute") == 1  # the start's statement alone


def test_while_another_start_places_this_one_goes_the_usual_way(tenant, placer):
    socket_of(make_agent(tenant, "here", max_concurrency=4))
    assert placer._turn.acquire(blocking=False)  # another start is placing right now
    try:
        _ready_and_alone(*start(tenant))
    finally:
        placer._turn.release()
    _execution_id, (root,) = start(tenant, workflow="next")
    assert isinstance(root.placed, Delivered)


def test_without_a_start_hook_the_start_is_its_one_statement(tenant):
    """The in-process executor (and a server without the fleet executor) registers none."""
    socket_of(make_agent(tenant, "here", max_concurrency=4))
    try:
        trips: list = []
        _ready_and_alone(*start(tenant, traced=trips))
        assert len(trips) == 1 and trips[0].count("Execute") == 1
    finally:
        local_sockets.clear()


def test_inside_a_callers_transaction_nothing_is_placed(tenant, placer):
    from django.db import transaction

    socket_of(make_agent(tenant, "here", max_concurrency=4))
    make_package(tenant, ONE, SOURCE, name="lone", workflow="lone")
    with transaction.atomic():
        execution_id, roots = scheduler.start_active(tenant.pk, "lone", {})
    _ready_and_alone(execution_id, roots)


def test_a_failed_placement_still_starts_the_execution(tenant, placer, monkeypatch):
    socket_of(make_agent(tenant, "here", max_concurrency=4))
    from fleet.executors.fleet.delivery import one_trip

    monkeypatch.setattr(one_trip, "START_STATEMENT", "SELECT no_such_column FROM fleet_tenant")
    _ready_and_alone(*start(tenant))
    assert not placer._turn.locked()  # its turn ended with the failed transaction


def test_a_push_lost_after_the_commit_is_redelivered_exactly_once(tenant, placer):
    """The server died between the start's commit and the push (the event never reached
    the loop): the row is delivered and unconfirmed; redelivery puts it back to pending and
    the relay of the agent's server pushes it, once."""
    agent = make_agent(tenant, "here", max_concurrency=4)
    written: list = []
    socket_of(agent, written)
    _execution_id, (root,) = start(tenant)
    placed = root.placed
    assert isinstance(placed, Delivered)  # … and its event is dropped: never pushed
    assert redeliver_unreceived(redeliver_s=0.0, max_pushes=5) == 1
    assert run_async(_relay_rounds(2)) == 1
    assert [p["task_execution_id"] for p in written] == [str(root.task_execution_id)]
    assert [p["outbox_id"] for p in written] == [placed.outbox_id]
    rows = list(DeliveryOutbox.objects.filter(task_execution_id=root.task_execution_id))
    assert [(r.pk, r.state, r.assignment, r.attempts) for r in rows] == [
        (placed.outbox_id, "delivered", placed.assignment, 2)
    ]
    task = TaskExecution.objects.get(pk=root.task_execution_id)
    assert (task.status, task.attempt, task.assignment) == ("Running", 1, placed.assignment)
    assert Agent.objects.get(pk=agent.pk).in_flight == 1  # one slot, not two


async def _relay_rounds(rounds: int) -> int:
    relay = Relay(poll_s=600)
    relay._last_reconcile = float("inf")  # rounds only take rows: no roster check here
    try:
        return sum([await relay.run_once() for _ in range(rounds)])
    finally:
        await relay.stop()
