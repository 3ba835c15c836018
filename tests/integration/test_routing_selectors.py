"""Each task selector, and transient (NoFreeAgent) vs permanent (NoMatchingAgent).

Real PostgreSQL, the real placement transaction (claim → selection → reservation →
outbox row); agents are roster rows holding a (pretend) socket of this process.
"""

from __future__ import annotations

from collections import Counter

import pytest
from django.test import Client

from agents.models import Agent
from fleet.api.error_status import http_status
from fleet.engine.events import ExecutionStatus
from fleet.executors.fleet.delivery.placement import NoAgent, Placed, Unroutable, place_task
from fleet.models import TaskExecution, TaskOutcome
from tests.support.factories import start
from tests.support.keys import bearer
from tests.support.routing import agent, place_root, placed_on, routed_package

pytestmark = pytest.mark.django_db


def place_many(tenant, count: int) -> list[str]:
    names = []
    for _ in range(count):
        result, _task = place_root(tenant)
        assert isinstance(result, Placed), result
        names.append(result.agent_name)
    return names


# -- direct ----------------------------------------------------------------------------


def test_it_sends_a_task_naming_an_agent_to_that_agent(tenant):
    routed_package(tenant, agent="w2")
    agent(tenant, "w1", max_concurrency=8)
    agent(tenant, "w2", max_concurrency=1)
    result, task = place_root(tenant)
    assert isinstance(result, Placed) and result.agent_name == "w2"
    assert placed_on(task) == "w2"


def test_a_named_agent_that_is_full_makes_the_task_wait(tenant):
    routed_package(tenant, agent="w2")
    agent(tenant, "w1", max_concurrency=8)
    agent(tenant, "w2", max_concurrency=1, in_flight=1)
    result, task = place_root(tenant)
    assert isinstance(result, NoAgent)
    assert (task.status, task.attempt) == ("Ready", 0)
    assert task.wait_reason.startswith("NoFreeAgent: 1 live agent(s) match (agent 'w2')")
    assert "at capacity" in task.wait_reason


def test_a_name_no_agent_is_registered_under_fails_the_task_at_once(tenant, read_key):
    routed_package(tenant, agent="nobody", retries=3)
    agent(tenant, "w1")
    result, task = place_root(tenant)
    assert isinstance(result, Unroutable) and result.status == ExecutionStatus.FAILED
    assert (task.status, task.error_type) == ("Failed", "NoMatchingAgent")
    assert task.error_message == "no agent named 'nobody' is registered in tenant acme"
    assert (
        TaskOutcome.objects.get(task_execution=task).outcome == "failure"
    )  # no retry: 3 were allowed
    # …and the API shows why.
    body = Client().get(f"/api/v1/executions/{task.workflow_execution_id}", **bearer(read_key))
    by_id = {t["task_id"]: t for t in body.json()["tasks"]}
    assert by_id["a"]["error"] == (
        "NoMatchingAgent: no agent named 'nobody' is registered in tenant acme"
    )
    assert by_id["b"]["status"] == "Skipped"
    assert body.json()["status"] == "Failed"
    # …and so does the console's execution page.
    from django.contrib.auth import get_user_model

    from fleet.models import TenantMembership

    user = get_user_model().objects.create_user("reader", "r@example.com", "x")
    TenantMembership.objects.create(user=user, tenant=tenant, role="read")
    console = Client()
    console.force_login(user)
    page = console.get(f"/console/executions/{task.workflow_execution_id}/").content.decode()
    assert (
        "<strong>NoMatchingAgent</strong>: no agent named &#x27;nobody&#x27; is registered" in page
    )


def test_a_named_agent_that_is_registered_but_silent_is_waited_for(tenant):
    routed_package(tenant, agent="w2")
    agent(tenant, "w1")
    agent(tenant, "w2", heartbeat_age_s=3600)  # past the window, not yet evicted
    result, task = place_root(tenant)
    assert isinstance(result, NoAgent) and task.status == "Ready"


# -- tags and capabilities: round-robin among the matches -------------------------------


def test_tags_select_agents_having_all_of_them_in_turn(tenant):
    routed_package(tenant, tags=["gpu", "fast"])
    agent(tenant, "w1", tags=["gpu", "fast", "eu"], max_concurrency=8)
    agent(tenant, "w2", tags=["gpu"], max_concurrency=8)  # lacks "fast"
    agent(tenant, "w3", tags=["fast", "gpu"], max_concurrency=8)
    agent(tenant, "w4", max_concurrency=8)
    names = place_many(tenant, 6)
    assert Counter(names) == {"w1": 3, "w3": 3}
    assert all(a != b for a, b in zip(names, names[1:], strict=False))  # alternating


def test_a_capability_selects_agents_declaring_it_in_turn(tenant):
    routed_package(tenant, capability="llama-3")
    agent(tenant, "w1", capabilities=["llama-3", "whisper"], max_concurrency=8)
    agent(tenant, "w2", capabilities=["whisper"], max_concurrency=8)
    agent(tenant, "w3", capabilities=["llama-3"], max_concurrency=8)
    names = place_many(tenant, 4)
    assert Counter(names) == {"w1": 2, "w3": 2}


def test_tags_no_live_agent_has_fail_the_task_naming_the_agents(tenant):
    routed_package(tenant, tags=["gpu"], retries=2)
    agent(tenant, "w1", tags=["cpu"])
    agent(tenant, "w2")
    result, task = place_root(tenant)
    assert isinstance(result, Unroutable)
    assert task.error_type == "NoMatchingAgent"
    assert task.error_message == (
        "none of the 2 live agent(s) of tenant acme matches tags [gpu]: "
        "w1 (tags [cpu], capabilities []); w2 (tags [], capabilities [])"
    )


def test_with_no_live_agent_at_all_a_tagged_task_waits(tenant):
    routed_package(tenant, tags=["gpu"])
    agent(tenant, "gone", tags=["cpu"], state="dead")
    result, task = place_root(tenant)
    assert isinstance(result, NoAgent)
    assert task.wait_reason == "no live agent in tenant acme"


def test_matching_agents_without_a_socket_make_the_task_wait(tenant):
    routed_package(tenant, tags=["gpu"])
    agent(tenant, "w1", tags=["gpu"], connected=False)  # unhealthy: never selected
    agent(tenant, "w2", tags=["cpu"])
    result, task = place_root(tenant)
    assert isinstance(result, NoAgent)
    assert task.wait_reason == (
        "NoFreeAgent: 1 live agent(s) match (tags [gpu]) but none is connected"
    )


# -- GPU, resource floors, fallback score ----------------------------------------------


def test_gpu_work_goes_to_an_agent_reporting_a_gpu(tenant):
    routed_package(tenant, gpu=True)
    agent(tenant, "cpu-box", max_concurrency=8)
    agent(tenant, "gpu-box", metrics={"gpu_count": 1, "free_vram_pct": 50.0})
    result, _ = place_root(tenant)
    assert result.agent_name == "gpu-box"


def test_a_gpu_model_name_matches_the_reported_gpu_names(tenant):
    routed_package(tenant, gpu="a100")
    agent(tenant, "t4", metrics={"gpu_count": 1, "gpus": [{"name": "Tesla T4"}]})
    agent(tenant, "a100", metrics={"gpu_count": 1, "gpus": [{"name": "NVIDIA A100-SXM4-40GB"}]})
    result, _ = place_root(tenant)
    assert result.agent_name == "a100"


def test_a_vram_floor_waits_while_no_gpu_has_that_much_free(tenant):
    routed_package(tenant, min_free_vram_pct=60)
    box = agent(tenant, "gpu-box", metrics={"gpu_count": 1, "free_vram_pct": 20.0})
    result, task = place_root(tenant)
    assert isinstance(result, NoAgent)
    assert task.wait_reason.endswith("but none has ≥ 60% free GPU memory now")
    Agent.objects.filter(pk=box.pk).update(metrics={"gpu_count": 1, "free_vram_pct": 70.0})
    from fleet.executors.fleet.delivery.placement import place_task

    assert isinstance(place_task(task.pk, "s"), Placed)


def test_memory_and_cpu_floors_pick_an_agent_meeting_both(tenant):
    routed_package(tenant, min_free_memory_mb=4096, min_free_cpu_pct=50)
    agent(tenant, "small", metrics={"free_memory_mb": 1000, "free_cpu_pct": 95.0})
    agent(tenant, "busy", metrics={"free_memory_mb": 9000, "free_cpu_pct": 10.0})
    agent(tenant, "right", metrics={"free_memory_mb": 9000, "free_cpu_pct": 60.0})
    agent(tenant, "silent", metrics={})  # reports nothing: cannot be shown to meet a floor
    result, _ = place_root(tenant)
    assert result.agent_name == "right"


def test_a_metric_of_the_wrong_type_never_breaks_selection(tenant):
    routed_package(tenant, min_free_memory_mb=10)
    agent(tenant, "odd", metrics={"free_memory_mb": "lots", "free_cpu_pct": [1]})
    agent(tenant, "fine", metrics={"free_memory_mb": 100})
    result, _ = place_root(tenant)
    assert result.agent_name == "fine"


def test_the_fallback_prefers_the_least_loaded_agent_then_takes_turns(tenant):
    routed_package(tenant)
    # Free slots rank before the host score (test_routing_ranking.py): the loaded host has
    # no more room than the idle ones, so the score decides.
    agent(
        tenant, "loaded", metrics={"free_cpu_pct": 5.0, "memory_free_pct": 10.0}, max_concurrency=1
    )
    agent(
        tenant, "idle-1", metrics={"free_cpu_pct": 90.0, "memory_free_pct": 80.0}, max_concurrency=2
    )
    agent(
        tenant, "idle-2", metrics={"free_cpu_pct": 88.0, "memory_free_pct": 81.0}, max_concurrency=2
    )
    names = place_many(tenant, 5)
    # Same score band: round-robin between the idle ones; the loaded one only once they are full.
    assert sorted(names[:4]) == ["idle-1", "idle-1", "idle-2", "idle-2"]
    assert names[0] != names[1] and names[4] == "loaded"


# -- exclusive agents ------------------------------------------------------------------


def test_an_exclusive_agent_takes_only_work_that_targets_it(tenant):
    routed_package(tenant)
    routed_package(tenant, workflow="tagged", tags=["special"])
    agent(tenant, "vip", tags=["special"], exclusive=True, max_concurrency=8)
    agent(tenant, "common", max_concurrency=8)
    assert set(place_many(tenant, 3)) == {"common"}
    result, _ = place_root(tenant, workflow="tagged")
    assert result.agent_name == "vip"


def test_untargeted_work_fails_when_every_live_agent_is_exclusive(tenant):
    routed_package(tenant)
    agent(tenant, "vip", exclusive=True)
    result, task = place_root(tenant)
    assert isinstance(result, Unroutable)
    assert "accepts untargeted work (every one is exclusive)" in task.error_message


# -- health: degraded after healthy, unhealthy never -----------------------------------


def test_a_degraded_agent_is_chosen_only_when_no_healthy_one_has_as_much_room(tenant):
    routed_package(tenant)
    # Degraded: no beat for 2.5 intervals (default interval 15 s, window 45 s), socket open.
    # Free slots rank before health (test_routing_ranking.py): it has no more room than
    # the healthy one, so health decides.
    late = agent(tenant, "late", heartbeat_age_s=37.5, max_concurrency=1)
    agent(tenant, "fresh", max_concurrency=2)
    assert place_many(tenant, 3) == ["fresh", "fresh", "late"]
    late.refresh_from_db()
    assert late.in_flight == 1


def test_an_agent_past_the_window_or_without_a_socket_is_never_chosen(tenant):
    routed_package(tenant)
    agent(tenant, "stale", heartbeat_age_s=46)
    agent(tenant, "no-socket", connected=False)
    result, task = place_root(tenant)
    assert isinstance(result, NoAgent) and task.status == "Ready"


# -- bad selectors ---------------------------------------------------------------------


def test_an_affinity_of_neither_form_is_refused_at_upload(tenant):
    from artifacts.store.services import UploadRejected

    with pytest.raises(UploadRejected) as refused:
        routed_package(tenant, affinity="sticky")
    assert http_status(refused.value) == 422
    assert str(refused.value).endswith(
        'affinity must be "definition" or "payload:<context key>", got \'sticky\''
    )


def test_an_unusable_stored_selector_fails_the_task_clearly(tenant):
    # A row written before the manifest checked affinity (or edited by hand).
    routed_package(tenant)
    agent(tenant, "w1")
    _, tasks = start(tenant, "demo")
    TaskExecution.objects.filter(pk=tasks["a"].pk).update(routing={"affinity": "sticky"})
    result = place_task(tasks["a"].pk, "s")
    task = TaskExecution.objects.get(pk=tasks["a"].pk)
    assert isinstance(result, Unroutable)
    assert task.error_type == "InvalidSelector"
    assert task.error_message == (
        "affinity must be 'definition' or 'payload:<context key>', got 'sticky'"
    )


def test_a_waiting_task_never_uses_an_attempt(tenant):
    routed_package(tenant, tags=["gpu"])
    agent(tenant, "w1", tags=["gpu"], max_concurrency=1, in_flight=1)
    for _ in range(3):
        result, task = place_root(tenant)
        assert isinstance(result, NoAgent)
    assert set(TaskExecution.objects.filter(task_name="a").values_list("attempt", flat=True)) == {0}
    assert TaskOutcome.objects.count() == 0
