"""Large contexts: by reference past the frame limit, refused past the configured maximum."""

from __future__ import annotations

import hashlib

import pytest
from django.test import Client

from agents.protocol.work import PacketError, parse_packet
from fleet.engine.context import build_task_context, encode_context
from fleet.engine.results import TaskReport, result_handler
from fleet.executors.fleet.delivery.context_ref import INLINE_MAX_BYTES
from fleet.executors.fleet.delivery.placement import Placed, Unroutable, place_task
from fleet.models import DeliveryOutbox, TaskExecution, TaskOutcome
from fleet.platform.config import reset_config
from tests.support.agents import make_agent
from tests.support.factories import start
from tests.support.keys import bearer
from tests.support.routing import routed_package

pytestmark = pytest.mark.django_db

BIG = '"quoted" and \\ backslashed ' * 30_000  # ~850 kB of text, ~1 MB JSON-escaped


def test_a_context_too_large_for_a_frame_travels_by_reference(tenant, agent_key):
    routed_package(tenant)
    agent = make_agent(tenant, "w1")
    _, tasks = start(tenant, "demo", {"blob": BIG})
    placed = place_task(tasks["a"].pk, "s")
    assert isinstance(placed, Placed)
    payload = DeliveryOutbox.objects.get(task_execution=tasks["a"]).payload
    text = encode_context(build_task_context(tasks["a"].pk))
    assert len(text.encode()) < INLINE_MAX_BYTES < len(text.encode()) * 1.3  # escaping counts
    assert "context_json" not in payload
    assert payload["context_ref"] == {
        "bytes": len(text.encode()), "sha256": hashlib.sha256(text.encode()).hexdigest(),
    }  # fmt: skip
    # The agent it is addressed to fetches exactly those bytes.
    url = f"/api/v1/agents/{agent.pk}/tasks/{tasks['a'].pk}/context?assignment={placed.assignment}"
    response = Client().get(url, **bearer(agent_key))
    assert response.status_code == 200
    assert response.content == text.encode()
    # Another assignment, another agent, another role: refused.
    stale = url.replace(f"assignment={placed.assignment}", "assignment=99")
    assert Client().get(stale, **bearer(agent_key)).status_code == 404
    other = make_agent(tenant, "w2")
    wrong = Client().get(url.replace(str(agent.pk), str(other.pk)), **bearer(agent_key))
    assert wrong.status_code == 404 and "is addressed to this agent" in wrong.json()["detail"]
    assert Client().get(url).status_code == 401


def test_a_small_context_stays_inline(tenant):
    routed_package(tenant)
    make_agent(tenant, "w1")
    _, tasks = start(tenant, "demo", {"small": "x" * 1000})
    place_task(tasks["a"].pk, "s")
    payload = DeliveryOutbox.objects.get(task_execution=tasks["a"]).payload
    assert "context_ref" not in payload and '"small"' in payload["context_json"]


def test_once_the_packet_is_acked_its_context_is_no_longer_served(tenant, agent_key):
    routed_package(tenant)
    agent = make_agent(tenant, "w1")
    _, tasks = start(tenant, "demo", {"blob": BIG})
    placed = place_task(tasks["a"].pk, "s")
    result_handler.apply(
        TaskReport(tasks["a"].pk, placed.assignment, "success", output={}, agent_id=agent.pk)
    )
    url = f"/api/v1/agents/{agent.pk}/tasks/{tasks['a'].pk}/context?assignment={placed.assignment}"
    assert Client().get(url, **bearer(agent_key)).status_code == 404


def test_a_context_over_the_maximum_fails_the_task_without_retrying(tenant, monkeypatch):
    # Each upstream output fits the limit; merged, they do not.
    tasks = [
        {"id": "left", "function": "demo.steps:a"},
        {"id": "right", "function": "demo.steps:a"},
        {"id": "join", "function": "demo.steps:b", "dependencies": ["left", "right"],
         "retries": 3},
    ]  # fmt: skip
    routed_package(tenant, tasks=tasks)
    agent = make_agent(tenant, "w1", max_concurrency=4)
    monkeypatch.setenv("CLOACINA_MAX_CONTEXT_BYTES", "1500000")
    reset_config()
    try:
        execution, started = start(tenant, "demo")
        for name in ("left", "right"):
            placed = place_task(started[name].pk, "s")
            applied = result_handler.apply(
                TaskReport(started[name].pk, placed.assignment, "success",
                           output={name: "y" * 900_000}, agent_id=agent.pk)
            )  # fmt: skip
            assert applied.applied, applied.reason
        result = place_task(started["join"].pk, "s")
    finally:
        monkeypatch.delenv("CLOACINA_MAX_CONTEXT_BYTES")
        reset_config()
    assert isinstance(result, Unroutable)
    join = TaskExecution.objects.get(pk=started["join"].pk)
    assert (join.status, join.error_type, join.attempt) == ("Failed", "ContextTooLarge", 1)
    assert join.error_message.startswith("the task's input context is 1800")
    assert "over the 1500000-byte limit (CLOACINA_MAX_CONTEXT_BYTES)" in join.error_message
    assert TaskOutcome.objects.filter(task_execution=join).count() == 1
    assert not DeliveryOutbox.objects.filter(task_execution=join).exists()
    execution.refresh_from_db()
    assert execution.status == "Failed"


def test_the_agent_accepts_a_packet_with_a_reference_and_refuses_a_bad_one():
    packet = {
        "outbox_id": 1, "task_execution_id": "5f0e1c7e-0000-4000-8000-000000000001",
        "assignment": 1, "function": "m:f", "artifact_digest": "a" * 64,
        "target_triple": "x86_64-unknown-linux-gnu", "timeout_s": 5.0,
        "context_ref": {"bytes": 12, "sha256": "b" * 64},
    }  # fmt: skip
    parsed = parse_packet(packet)
    assert parsed.context_ref == {"bytes": 12, "sha256": "b" * 64}
    assert parsed.context_json == ""
    with pytest.raises(PacketError, match="context_ref must be"):
        parse_packet({**packet, "context_ref": {"bytes": "12", "sha256": "b" * 64}})
    with pytest.raises(PacketError, match="missing context_json"):
        parse_packet({k: v for k, v in packet.items() if k != "context_ref"})
