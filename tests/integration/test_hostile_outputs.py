"""Hostile task outputs and outcomes: NaN, values JSON cannot hold, NUL characters, an
output that is not an object, a hostile agent posting such outputs itself, and the same
outcome posted many times at once.  A bad output fails its task with a clear error and
stores nothing of it; of concurrent copies of one outcome exactly one is applied.

Here: the integration tests (database, in-process ASGI, fakes); the rest are in tests/e2e/test_hostile_outputs.py.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.test import Client

from fleet.models import TaskExecution, TaskOutcome
from tests.support.agents import make_agent
from tests.support.factories import two_task_package
from tests.support.keys import bearer
from tests.support.outcomes import delivered_task, result_body


def _post_raw(client: Client, agent, key: str, text: str):
    return client.post(
        f"/api/v1/agents/{agent.id}/results", data=text, content_type="application/json",
        **bearer(key),
    )  # fmt: skip


@pytest.mark.django_db(transaction=True)  # the result endpoint works on its own DB threads
def test_an_agent_posting_nan_or_an_oversized_output_fails_the_task(agent_key, tenant):
    from fleet.platform.config import get_config

    two_task_package(tenant)
    agent = make_agent(tenant)
    client = Client()
    # json.dumps writes NaN as the bare token NaN, as a careless agent would: not JSON, so
    # the body is refused naming it (jsonb cannot store it) and nothing is recorded; the
    # agent's fallback (a failure naming the rejection, see outcome_reporter) then applies.
    task, row = delivered_task(tenant, agent)
    text = json.dumps(result_body(task, row, output={"x": float("nan")}))
    answer = _post_raw(client, agent, agent_key, text)
    assert answer.status_code == 422 and "NaN is not a JSON number" in answer.json()["detail"]
    task.refresh_from_db()
    assert task.status == "Running" and not TaskOutcome.objects.filter(task_execution=task).exists()
    fallback = result_body(task, row, outcome="failure", output=None, error_type="ResultRejected")
    assert _post_raw(client, agent, agent_key, json.dumps(fallback)).json()["applied"] is True
    task.refresh_from_db()
    assert (task.status, task.error_type, task.output_context) == (
        "Failed", "ResultRejected", None,
    )  # fmt: skip

    limit = get_config().max_context_bytes
    task, row = delivered_task(tenant, agent)
    big = result_body(task, row, output={"blob": "x" * limit})
    answer = _post_raw(client, agent, agent_key, json.dumps(big))
    assert answer.status_code == 200 and answer.json()["applied"] is True
    task.refresh_from_db()
    assert (task.status, task.error_type, task.output_context) == (
        "Failed", "InvalidTaskOutput", None,
    )  # fmt: skip
    assert f"over the {limit}-byte limit" in task.error_message


@pytest.mark.django_db(transaction=True)
def test_an_agent_posting_nul_is_refused_and_nothing_is_recorded(agent_key, tenant):
    two_task_package(tenant)
    agent = make_agent(tenant)
    task, row = delivered_task(tenant, agent)
    for field, value in (("output", {"x": "\x00"}), ("error_message", "bad\x00")):
        body = result_body(task, row, **{field: value})
        answer = _post_raw(Client(), agent, agent_key, json.dumps(body))
        assert answer.status_code == 422 and "NUL character" in answer.json()["detail"]
    task.refresh_from_db()
    assert task.status == "Running" and not TaskOutcome.objects.filter(task_execution=task).exists()
    # The agent's fallback (a failure without the bad text, see outcome_reporter) applies.
    body = result_body(task, row, outcome="failure", output=None, error_type="ResultRejected")
    assert _post_raw(Client(), agent, agent_key, json.dumps(body)).json()["applied"] is True


COPIES = 12


@pytest.mark.django_db(transaction=True)
def test_an_outcome_posted_many_times_at_once_is_applied_once(agent_key, tenant):
    two_task_package(tenant)
    agent = make_agent(tenant)
    task, row = delivered_task(tenant, agent)
    barrier = threading.Barrier(COPIES)

    def post(i: int) -> dict:
        body = json.dumps(result_body(task, row, output={"copy": i}))
        client = Client()
        barrier.wait()
        response = _post_raw(client, agent, agent_key, body)
        assert response.status_code == 200, response.content
        return response.json()

    with ThreadPoolExecutor(COPIES) as pool:
        answers = list(pool.map(post, range(COPIES)))
    applied = [a for a in answers if a["applied"]]
    assert len(applied) == 1, answers
    task.refresh_from_db()
    assert task.status == "Completed" and set(task.output_context) == {"copy"}
    assert TaskOutcome.objects.filter(task_execution=task, applied=True).count() == 1
    # The slot was given back once (a second release would have gone below zero).
    agent.refresh_from_db()
    row.refresh_from_db()
    assert (agent.in_flight, row.state) == (0, "acked")
    # The dependent was made Ready once, and the server goes on: it completes normally.
    b = TaskExecution.objects.get(workflow_execution=task.workflow_execution, task_name="b")
    assert (b.status, b.attempt) == ("Ready", 0)


@pytest.mark.django_db(transaction=True)
def test_an_outcome_re_posted_in_a_loop_is_recorded_a_bounded_number_of_times(agent_key, tenant):
    from fleet.engine.results import MAX_UNAPPLIED_OUTCOMES_PER_TASK

    two_task_package(tenant)
    agent = make_agent(tenant)
    task, row = delivered_task(tenant, agent)
    body = json.dumps(result_body(task, row))
    client = Client()
    answers = [_post_raw(client, agent, agent_key, body).json() for _ in range(80)]
    assert [a["applied"] for a in answers].count(True) == 1
    assert TaskOutcome.objects.filter(task_execution=task, applied=True).count() == 1
    assert TaskOutcome.objects.filter(task_execution=task, applied=False).count() == (
        MAX_UNAPPLIED_OUTCOMES_PER_TASK
    )


@pytest.mark.django_db(transaction=True)
def test_an_outcome_naming_numbers_past_their_columns_is_refused_cleanly(agent_key, tenant):
    """An outbox id or assignment no column can hold is an unknown packet (or a 422), never
    a 500 (the API fuzzer found one)."""
    two_task_package(tenant)
    agent = make_agent(tenant)
    task, row = delivered_task(tenant, agent)
    for extra in ({"assignment": 2**40}, {"outbox_id": 2**63}, {"outbox_id": 2**70}):
        body = json.dumps(result_body(task, row, **extra))
        answer = _post_raw(Client(), agent, agent_key, body)
        assert answer.status_code in (404, 422), (extra, answer.status_code, answer.content)
    task.refresh_from_db()
    assert task.status == "Running" and not TaskOutcome.objects.filter(task_execution=task).exists()
