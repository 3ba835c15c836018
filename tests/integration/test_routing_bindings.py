"""Task groups and affinity: bindings in the database, cleared when their agent dies."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from agents.models import Agent
from fleet.engine.results import TaskReport, result_handler
from fleet.executors.fleet.delivery.placement import NoAgent, Placed, place_task
from fleet.executors.fleet.lifecycle import evict_agent, request_drain, sweep_dead_agents
from fleet.executors.fleet.routing import groups
from fleet.models import AffinityBinding, DeliveryOutbox, TaskExecution
from tests.support.factories import start
from tests.support.routing import agent, place_root, routed_package

pytestmark = pytest.mark.django_db

GROUPED = [
    {"id": "load", "function": "demo.steps:a", "group": "g"},
    {"id": "train", "function": "demo.steps:a", "group": "g"},
    {"id": "score", "function": "demo.steps:a", "group": "g"},
    {"id": "other", "function": "demo.steps:a"},
]


def place(task) -> Placed | NoAgent:
    return place_task(task.pk, "test-server")


def test_the_first_task_of_a_group_binds_its_agent_for_the_rest(tenant):
    routed_package(tenant, tasks=GROUPED)
    agent(tenant, "w1", max_concurrency=8)
    agent(tenant, "w2", max_concurrency=8)
    execution, tasks = start(tenant, "demo")
    first = place(tasks["load"])
    bound = first.agent_name
    # Round-robin alone would alternate; the group keeps its tasks together.
    assert [place(tasks[t]).agent_name for t in ("train", "score")] == [bound, bound]
    assert place(tasks["other"]).agent_name != bound
    binding = AffinityBinding.objects.get()
    assert (binding.kind, binding.agent.name, binding.workflow_execution_id) == (
        "group", bound, execution.pk,
    )  # fmt: skip
    # Another execution's group binds on its own: with the first agent full, elsewhere.
    Agent.objects.filter(name=bound).update(in_flight=8)
    other_execution, again = start(tenant, "demo")
    elsewhere = place(again["load"]).agent_name
    assert elsewhere != bound
    assert AffinityBinding.objects.get(workflow_execution=other_execution).agent.name == elsewhere
    assert AffinityBinding.objects.get(workflow_execution=execution).agent.name == bound


def test_a_group_task_waits_for_its_full_agent_rather_than_going_elsewhere(tenant):
    routed_package(tenant, tasks=GROUPED)
    agent(tenant, "w1", max_concurrency=1)
    agent(tenant, "w2", max_concurrency=8)
    _, tasks = start(tenant, "demo")
    bound = place(tasks["load"]).agent_name
    slots = Agent.objects.get(name=bound).max_concurrency
    Agent.objects.filter(name=bound).update(in_flight=slots)  # the bound agent is full
    result = place(tasks["train"])
    assert isinstance(result, NoAgent)
    task = TaskExecution.objects.get(pk=tasks["train"].pk)
    assert task.status == "Ready"
    assert task.wait_reason == (
        f"NoFreeAgent: waiting for agent {bound}, bound by its group: "
        f"at capacity ({slots} of {slots} slots)"
    )
    # Without its socket it still waits (not dead: the liveness sweep decides that).
    Agent.objects.filter(name=bound).update(in_flight=0, connected_to="")
    assert isinstance(place(tasks["train"]), NoAgent)
    task.refresh_from_db()
    assert task.wait_reason.endswith("bound by its group: it has no delivery socket")


def test_a_group_rebinds_when_its_agent_dies(tenant):
    routed_package(tenant, tasks=GROUPED)
    w1 = agent(tenant, "w1", max_concurrency=8)
    agent(tenant, "w2", max_concurrency=8)
    _, tasks = start(tenant, "demo")
    AffinityBinding.objects.all().delete()
    Agent.objects.filter(name="w2").update(in_flight=8)  # so the group binds w1
    assert place(tasks["load"]).agent_name == "w1"
    Agent.objects.filter(name="w2").update(in_flight=0)
    evict_agent(w1.pk, "test: died")
    # Cleared with the eviction; the reclaimed "load" bound the group to the survivor.
    assert DeliveryOutbox.objects.get(task_execution=tasks["load"]).agent.name == "w2"
    assert AffinityBinding.objects.get().agent.name == "w2"
    assert place(tasks["train"]).agent_name == "w2"
    assert place(tasks["score"]).agent_name == "w2"
    assert AffinityBinding.objects.get().agent.name == "w2"


def test_definition_affinity_pins_every_execution_of_the_workflow(tenant):
    routed_package(tenant, affinity="definition")
    agent(tenant, "w1", max_concurrency=8)
    agent(tenant, "w2", max_concurrency=8)
    names = [place_root(tenant)[0].agent_name for _ in range(4)]
    assert len(set(names)) == 1
    binding = AffinityBinding.objects.get()
    assert (binding.kind, binding.key, binding.workflow_execution_id) == (
        "definition", "definition:demo", None,
    )  # fmt: skip


def test_payload_affinity_pins_executions_with_the_same_context_value(tenant):
    routed_package(tenant, affinity="payload:customer")
    agent(tenant, "w1", max_concurrency=8)
    agent(tenant, "w2", max_concurrency=8)
    c1 = place_root(tenant, context={"customer": "c1"})[0].agent_name
    c2 = place_root(tenant, context={"customer": {"id": 2}})[0].agent_name
    assert c1 != c2  # the second binds the least recently selected agent
    assert place_root(tenant, context={"customer": "c1"})[0].agent_name == c1
    assert place_root(tenant, context={"customer": {"id": 2}})[0].agent_name == c2
    place_root(tenant, context={"no": "customer"})  # not bound: no key in its context
    assert AffinityBinding.objects.filter(kind="payload").count() == 2


def test_the_liveness_sweep_clears_a_dead_agents_bindings_and_work_goes_elsewhere(tenant):
    routed_package(tenant, affinity="definition")
    w1 = agent(tenant, "w1", max_concurrency=8)
    agent(tenant, "w2", max_concurrency=8)
    Agent.objects.filter(pk=w1.pk).update(last_selected_at=None)
    Agent.objects.filter(name="w2").update(last_selected_at=timezone.now())
    assert place_root(tenant)[0].agent_name == "w1"
    # w1 falls silent past the liveness window (default 15 s × 3): the sweep evicts it.
    Agent.objects.filter(pk=w1.pk).update(last_heartbeat=timezone.now() - timedelta(seconds=60))
    evictions = sweep_dead_agents()
    assert [e.agent_name for e in evictions] == ["w1"]
    assert not AffinityBinding.objects.filter(agent=w1).exists()
    assert place_root(tenant)[0].agent_name == "w2"
    assert AffinityBinding.objects.get().agent.name == "w2"
    # The reclaimed packet of the first run also went to w2.
    assert set(DeliveryOutbox.objects.values_list("agent__name", flat=True)) == {"w2"}


def test_a_draining_agent_loses_its_bindings(tenant):
    routed_package(tenant, affinity="definition")
    agent(tenant, "w1", max_concurrency=8)
    agent(tenant, "w2", max_concurrency=8)
    first = place_root(tenant)[0]
    request_drain(first.agent_id, 60, "test")
    assert not AffinityBinding.objects.exists()
    second = place_root(tenant)[0]
    assert second.agent_name != first.agent_name


def test_a_bound_agent_that_does_not_match_a_tasks_selectors_is_ignored(tenant):
    tasks = [
        {"id": "prep", "function": "demo.steps:a", "group": "g"},
        {"id": "gpu", "function": "demo.steps:a", "group": "g", "tags": ["gpu"]},
    ]
    routed_package(tenant, tasks=tasks)
    agent(tenant, "cpu", max_concurrency=8)
    Agent.objects.filter(name="cpu").update(last_selected_at=None)
    agent(tenant, "gpu-box", tags=["gpu"], max_concurrency=8)
    Agent.objects.filter(name="gpu-box").update(last_selected_at=timezone.now())
    _, started = start(tenant, "demo")
    assert place(started["prep"]).agent_name == "cpu"
    assert place(started["gpu"]).agent_name == "gpu-box"
    assert AffinityBinding.objects.get().agent.name == "cpu"  # the group stays bound


def test_reclaimed_work_only_goes_to_an_agent_its_selectors_accept(tenant):
    routed_package(tenant, tags=["gpu"])
    g1 = agent(tenant, "g1", tags=["gpu"])
    agent(tenant, "cpu", max_concurrency=8)
    result, task = place_root(tenant)
    assert result.agent_name == "g1"
    evict_agent(g1.pk, "test: died")
    row = DeliveryOutbox.objects.get(task_execution=task)
    assert row.agent_id == g1.pk and row.state == "pending"  # no gpu survivor: it waits
    agent(tenant, "g2", tags=["gpu"])
    sweep_dead_agents()
    row.refresh_from_db()
    assert (row.agent.name, row.state, row.former_agents) == ("g2", "pending", [str(g1.pk)])


def test_group_bindings_go_when_their_execution_finishes(tenant):
    routed_package(tenant, tasks=[{"id": "only", "function": "demo.steps:a", "group": "g"}])
    agent(tenant, "w1")
    execution, tasks = start(tenant, "demo")
    placed = place(tasks["only"])
    assert AffinityBinding.objects.count() == 1
    assert groups.prune_finished() == 0  # still running
    result_handler.apply(
        TaskReport(
            tasks["only"].pk, placed.assignment, "success", output={}, agent_id=placed.agent_id
        )
    )
    execution.refresh_from_db()
    assert execution.status == "Completed"
    assert groups.prune_finished() == 1 and not AffinityBinding.objects.exists()
