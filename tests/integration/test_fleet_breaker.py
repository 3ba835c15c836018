"""The per-agent circuit breaker (fleet/executors/fleet/state/breaker.py): what opens it,
what selection does with each state (single and batch placement), the probe that closes it,
and where it shows (GET /fleet, /metrics).  Defaults: 5 failures, 30 s cool-off, 300 s cap."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import pytest
from django.db.models.expressions import RawSQL
from django.utils import timezone
from prometheus_client import REGISTRY

from agents.models import Agent
from fleet.engine.recovery import expire_lost_runs
from fleet.executors.fleet.delivery.batch_placement import place_tasks
from fleet.executors.fleet.delivery.placement import Placed, reserve_agent
from fleet.executors.fleet.delivery.redelivery import redeliver_unreceived
from fleet.executors.fleet.result_intake import ResultIn, apply_results
from fleet.executors.fleet.routing.candidates import no_capacity_reason
from fleet.executors.fleet.state import breaker
from fleet.executors.fleet.state.breaker import BreakerState, Cause
from fleet.models import DeliveryOutbox, TaskExecution
from tests.support.agents import make_agent
from tests.support.factories import make_package, start, two_task_package
from tests.support.outcomes import delivered_task, result_body
from tests.support.routing import agent as routing_agent
from tests.support.routing import place_root, routed_package

THRESHOLD = 5  # CLOACINA_BREAKER_FAILURES' default
COOLOFF_S = 30.0  # CLOACINA_BREAKER_COOLOFF_S' default


def state(agent) -> BreakerState:
    agent.refresh_from_db()
    return breaker.state_of(agent.breaker_open_until, timezone.now())


def trips(cause: Cause) -> float:
    return REGISTRY.get_sample_value("cloacina_fleet_breaker_trips_total", {"cause": cause}) or 0.0


def open_breaker(agent, cause: Cause = Cause.REFUSAL) -> None:
    assert breaker.record_failures([agent.id] * THRESHOLD, cause) == [agent.id]


def cool_off_passed(agent) -> None:
    """As if the cool-off were over (the test does not wait 30 s).

    The end is set from the database's ``now()``, which placement compares it with: inside
    the test's transaction that is the transaction's start, which on a loaded machine can be
    seconds behind the client's clock (an end one second before the client's clock could
    still lie ahead of it)."""
    Agent.objects.filter(pk=agent.pk).update(
        breaker_open_until=RawSQL("now() - interval '1 second'", [])
    )


def remaining_s(agent) -> float:
    agent.refresh_from_db()
    return (agent.breaker_open_until - timezone.now()).total_seconds()


@pytest.mark.django_db
def test_consecutive_failures_open_the_breaker_and_selection_skips_the_agent(tenant):
    flaky = make_agent(tenant, "flaky", max_concurrency=4)
    make_agent(tenant, "steady", max_concurrency=2)
    before = trips(Cause.REFUSAL)
    assert breaker.record_failures([flaky.id] * (THRESHOLD - 1), Cause.REFUSAL) == []
    assert state(flaky) == BreakerState.CLOSED and flaky.breaker_failures == THRESHOLD - 1
    assert breaker.record_failures([flaky.id], Cause.REFUSAL) == [flaky.id]
    assert state(flaky) == BreakerState.OPEN
    assert COOLOFF_S - 5 < remaining_s(flaky) <= COOLOFF_S
    assert trips(Cause.REFUSAL) == before + 1
    # The most free agent, but open: the work goes to the other one until it is full.
    assert [reserve_agent(tenant.pk).name for _ in range(2)] == ["steady", "steady"]
    assert reserve_agent(tenant.pk) is None
    flaky.refresh_from_db()
    assert flaky.in_flight == 0


@pytest.mark.django_db
def test_the_wait_reason_says_the_breakers_are_open_not_that_agents_are_full(tenant):
    one, two = make_agent(tenant, "one"), make_agent(tenant, "two", max_concurrency=1)
    open_breaker(one)
    Agent.objects.filter(pk=two.pk).update(in_flight=1)
    assert no_capacity_reason(tenant.pk) == (
        "all 2 live agents are at capacity (1 with an open circuit breaker)"
    )
    open_breaker(two)
    assert no_capacity_reason(tenant.pk) == (
        "the circuit breaker of all 2 live agent(s) that could take it is open "
        "(no new work until its cool-off ends)"
    )


@pytest.mark.django_db
def test_a_task_with_selectors_waits_naming_the_open_breakers(tenant):
    routed_package(tenant, tags=["gpu"])
    gpu = routing_agent(tenant, "gpu-1", tags=["gpu"])
    routing_agent(tenant, "cpu-1")  # free, but not a match
    open_breaker(gpu)
    placement, task = place_root(tenant)
    assert not isinstance(placement, Placed) and task.status == "Ready"
    assert task.wait_reason == (
        "NoFreeAgent: 1 live agent(s) match (tags [gpu]); the circuit breaker of all 1 that "
        "could take it is open (no new work until its cool-off ends)"
    )
    cool_off_passed(gpu)
    placement, task = place_root(tenant)
    assert isinstance(placement, Placed) and placement.agent_name == "gpu-1"  # the probe


@pytest.mark.django_db
def test_a_success_resets_the_count_failures_must_be_consecutive(tenant):
    agent = make_agent(tenant, "a")
    breaker.record_failures([agent.id] * (THRESHOLD - 1), Cause.PUSH)
    assert breaker.record_successes([agent.id]) == []  # nothing closed: it was not open
    agent.refresh_from_db()
    assert agent.breaker_failures == 0
    breaker.record_failures([agent.id] * (THRESHOLD - 1), Cause.PUSH)
    assert state(agent) == BreakerState.CLOSED
    assert breaker.record_failures([agent.id], Cause.PUSH) == [agent.id]
    assert state(agent) == BreakerState.OPEN


@pytest.mark.django_db
def test_half_open_lets_exactly_one_probe_through_and_its_success_closes_it(tenant):
    flaky = make_agent(tenant, "flaky", max_concurrency=4)
    make_agent(tenant, "steady", max_concurrency=2)
    open_breaker(flaky)
    cool_off_passed(flaky)
    assert state(flaky) == BreakerState.HALF_OPEN
    assert reserve_agent(tenant.pk).name == "flaky"  # the probe
    flaky.refresh_from_db()
    assert flaky.breaker_probing and flaky.in_flight == 1
    # One probe only: the rest goes elsewhere, however many free slots it has.
    assert [reserve_agent(tenant.pk).name for _ in range(2)] == ["steady", "steady"]
    assert reserve_agent(tenant.pk) is None
    assert breaker.record_successes([flaky.id]) == [flaky.id]
    assert state(flaky) == BreakerState.CLOSED
    assert (flaky.breaker_failures, flaky.breaker_trips, flaky.breaker_probing) == (0, 0, False)
    assert reserve_agent(tenant.pk).name == "flaky"


@pytest.mark.django_db
def test_a_failed_probe_reopens_it_with_the_cool_off_doubled_and_capped(tenant):
    agent = make_agent(tenant, "a", max_concurrency=4)
    open_breaker(agent, Cause.RESULT_TIMEOUT)
    before = trips(Cause.RESULT_TIMEOUT)
    cool_off_passed(agent)
    assert reserve_agent(tenant.pk).name == "a"
    assert breaker.record_failures([agent.id], Cause.RESULT_TIMEOUT) == [agent.id]
    assert state(agent) == BreakerState.OPEN and agent.breaker_trips == 2
    assert 2 * COOLOFF_S - 5 < remaining_s(agent) <= 2 * COOLOFF_S
    assert trips(Cause.RESULT_TIMEOUT) == before + 1
    # Failures while open change nothing (its work in flight may still fail).
    until = agent.breaker_open_until
    assert breaker.record_failures([agent.id] * THRESHOLD, Cause.RESULT_TIMEOUT) == []
    agent.refresh_from_db()
    assert agent.breaker_open_until == until
    # Re-opened again and again, the cool-off stops at CLOACINA_BREAKER_MAX_COOLOFF_S.
    for _ in range(6):
        cool_off_passed(agent)
        breaker.record_failures([agent.id], Cause.RESULT_TIMEOUT)
    assert 300 - 5 < remaining_s(agent) <= 300


@pytest.mark.django_db
def test_a_probe_that_left_no_work_behind_lets_another_through(tenant):
    agent = make_agent(tenant, "a", max_concurrency=4)
    open_breaker(agent)
    cool_off_passed(agent)
    assert reserve_agent(tenant.pk).name == "a"
    assert reserve_agent(tenant.pk) is None
    # Its probe was withdrawn (a cancel) without an outcome: the slot is free again.
    Agent.objects.filter(pk=agent.pk).update(in_flight=0)
    assert reserve_agent(tenant.pk).name == "a"


@pytest.mark.django_db
def test_a_batch_deals_a_half_open_agent_one_slot_and_an_open_one_none(tenant):
    tasks = [{"id": f"t{i}", "function": "demo.steps:noop"} for i in range(10)]
    make_package(tenant, tasks, "def noop(context):\n    return None\n", name="w", workflow="w")
    probing = make_agent(tenant, "probing", max_concurrency=8)
    shut = make_agent(tenant, "shut", max_concurrency=8)
    make_agent(tenant, "steady", max_concurrency=8)
    open_breaker(probing)
    open_breaker(shut)
    cool_off_passed(probing)
    _execution, by_id = start(tenant, "w")
    placed = place_tasks([t.pk for t in by_id.values()], "server-1")
    per_agent = Counter(p.agent_name for p in placed.values() if isinstance(p, Placed))
    # Ten tasks, sixteen free slots on the agents that let work through — but the half-open
    # one takes its probe only: one task is left waiting.
    assert per_agent == {"steady": 8, "probing": 1}
    assert sum(not isinstance(p, Placed) for p in placed.values()) == 1
    probing.refresh_from_db()
    assert probing.breaker_probing


@pytest.mark.django_db(transaction=True)  # the results are applied as a socket batch
def test_refusals_count_against_the_agent_and_other_outcomes_for_it(tenant):
    two_task_package(tenant)
    agent = make_agent(tenant, "refuser", max_concurrency=THRESHOLD + 1)
    for _ in range(THRESHOLD - 1):
        task, row = delivered_task(tenant, agent)
        body = ResultIn(**result_body(task, row, outcome="refused", error_message="no"))
        assert apply_results([(tenant.pk, agent.id, body)])[0][0] == 200
    agent.refresh_from_db()
    assert agent.breaker_failures == THRESHOLD - 1
    task, row = delivered_task(tenant, agent)  # a failure of the task is the agent working
    apply_results([(tenant.pk, agent.id, ResultIn(**result_body(task, row, outcome="failure")))])
    agent.refresh_from_db()
    assert agent.breaker_failures == 0
    for _ in range(THRESHOLD):
        task, row = delivered_task(tenant, agent)
        body = ResultIn(**result_body(task, row, outcome="refused", error_message="no"))
        apply_results([(tenant.pk, agent.id, body)])
    assert state(agent) == BreakerState.OPEN


@pytest.mark.django_db
def test_result_timeouts_count_against_the_agent_that_held_the_run(tenant):
    two_task_package(tenant)
    agent = make_agent(tenant, "silent", max_concurrency=THRESHOLD)
    for _ in range(THRESHOLD):
        delivered_task(tenant, agent)
    TaskExecution.objects.filter(agent=agent).update(
        result_deadline=timezone.now() - timedelta(seconds=1)
    )
    before = trips(Cause.RESULT_TIMEOUT)
    assert expire_lost_runs() == THRESHOLD
    assert state(agent) == BreakerState.OPEN
    assert trips(Cause.RESULT_TIMEOUT) == before + 1


@pytest.mark.django_db
def test_unconfirmed_pushes_count_against_the_agent(tenant):
    two_task_package(tenant)
    agent = make_agent(tenant, "deaf", max_concurrency=THRESHOLD)
    for _ in range(THRESHOLD):
        delivered_task(tenant, agent)
    DeliveryOutbox.objects.filter(agent=agent).update(
        delivered_at=timezone.now() - timedelta(seconds=60)
    )
    assert redeliver_unreceived(10.0) == THRESHOLD
    assert state(agent) == BreakerState.OPEN


@pytest.mark.django_db
def test_the_breaker_shows_in_get_fleet_and_metrics(client, read_key, tenant, other_tenant):
    shut = make_agent(tenant, "shut")
    probing = make_agent(tenant, "probing")
    make_agent(tenant, "fine")
    make_agent(other_tenant, "elsewhere")
    open_breaker(shut)
    open_breaker(probing)
    cool_off_passed(probing)
    body = client.get("/api/v1/fleet", HTTP_AUTHORIZATION=f"Bearer {read_key}").json()
    by_name = {a["name"]: a for a in body["agents"]}
    assert {n: a["breaker"] for n, a in by_name.items()} == {
        "shut": "open",
        "probing": "half_open",
        "fine": "closed",
    }
    assert by_name["fine"]["breaker_open_until"] is None
    assert by_name["shut"]["breaker_open_until"] is not None
    text = client.get("/metrics").content.decode()
    for line in (
        f'cloacina_fleet_agents_breaker{{state="closed",tenant="{tenant.name}"}} 1.0',
        f'cloacina_fleet_agents_breaker{{state="open",tenant="{tenant.name}"}} 1.0',
        f'cloacina_fleet_agents_breaker{{state="half_open",tenant="{tenant.name}"}} 1.0',
        f'cloacina_fleet_agents_breaker{{state="closed",tenant="{other_tenant.name}"}} 1.0',
        f'cloacina_fleet_agents_breaker{{state="open",tenant="{other_tenant.name}"}} 0.0',
    ):
        assert line in text, line
    assert 'cloacina_fleet_breaker_trips_total{cause="refusal"}' in text
