"""The executions REST API: start, list, inspect, cancel; roles, tenancy, bad input, backlog."""

from __future__ import annotations

import json
import uuid

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from artifacts.store.testing import build_archive, package_files
from fleet.engine import ready_queue
from fleet.engine.claims import claim_task
from fleet.engine.results import TaskReport, result_handler
from fleet.models import TaskExecution, WorkflowExecution
from fleet.platform.config import apply_overrides, reset_config
from tests.support.keys import bearer

pytestmark = pytest.mark.django_db


@pytest.fixture
def client() -> Client:
    return Client()


def upload_demo(client: Client, key: str) -> None:
    """The a → b demo package (workflow "demo"), uploaded over the API."""
    data = build_archive(package_files())
    response = client.post(
        "/api/v1/packages", {"file": SimpleUploadedFile("demo.tar.gz", data)}, **bearer(key)
    )
    assert response.status_code == 201, response.content


@pytest.fixture
def demo(client, write_key) -> str:
    upload_demo(client, write_key)
    return "demo"


def start(client: Client, key: str, body: object, workflow: str = "demo"):
    return client.post(
        f"/api/v1/workflows/{workflow}/executions",
        data=json.dumps(body),
        content_type="application/json",
        **bearer(key),
    )


def get(client: Client, key: str, path: str):
    return client.get(f"/api/v1{path}", **bearer(key))


def run_task(execution_id: str, task_name: str, **report) -> None:
    """Claim one Ready task and report an outcome through the one result handler.

    Tests using it need ``transaction=True``: a claim compares ``ready_at`` with
    PostgreSQL's ``now()``, which inside the test's wrapping transaction would
    stay at the moment the test began.
    """
    task = TaskExecution.objects.get(workflow_execution_id=execution_id, task_name=task_name)
    claim = claim_task(task.pk, "test")
    assert claim is not None
    result_handler.apply(TaskReport(task.pk, claim.assignment, **report))


@pytest.fixture
def submitted():
    """Collect what the API hands to the dispatch loop's fast path."""
    events = []
    ready_queue.register(events.extend)
    yield events
    ready_queue.register(None)


# --- start ----------------------------------------------------------------------------


def test_it_starts_an_execution_and_offers_its_roots(client, write_key, read_key, demo, submitted):
    response = start(client, write_key, {"context": {"x": 1}, "priority": 5})
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["status"] == "Pending"
    execution = WorkflowExecution.objects.get(pk=body["id"])
    assert execution.input_context == {"x": 1} and execution.priority == 5
    assert [(e.task_name, e.attempt) for e in submitted] == [("a", 1)]
    assert submitted[0].workflow_execution_id == execution.pk

    detail = get(client, read_key, f"/executions/{body['id']}").json()
    assert detail["workflow"] == "demo" and detail["context"] is None
    assert detail["input_context"] == {"x": 1}
    assert [(t["task_id"], t["status"], t["attempt"]) for t in detail["tasks"]] == [
        ("a", "Ready", 0),
        ("b", "NotStarted", 0),
    ]


def test_context_defaults_to_an_empty_object(client, write_key, demo):
    response = start(client, write_key, {})
    assert response.status_code == 201
    assert WorkflowExecution.objects.get().input_context == {}


def test_it_404s_an_unknown_workflow(client, write_key, demo):
    response = start(client, write_key, {"context": {}}, workflow="nope")
    assert response.status_code == 404
    assert "nope" in response.json()["detail"]
    assert WorkflowExecution.objects.count() == 0


@pytest.mark.parametrize("context", [[1, 2], "text", 3])
def test_it_rejects_a_context_that_is_not_an_object(client, write_key, demo, context):
    response = start(client, write_key, {"context": context})
    assert response.status_code == 422
    assert "must be a JSON object" in response.json()["detail"]
    assert WorkflowExecution.objects.count() == 0


def test_it_rejects_an_oversized_context(client, write_key, demo):
    apply_overrides(max_context_bytes=64)
    try:
        response = start(client, write_key, {"context": {"blob": "x" * 100}})
    finally:
        reset_config()
    assert response.status_code == 422
    assert "over the 64-byte limit" in response.json()["detail"]
    assert WorkflowExecution.objects.count() == 0


def test_a_read_key_may_not_start(client, read_key, demo):
    response = start(client, read_key, {"context": {}})
    assert response.status_code == 403
    assert WorkflowExecution.objects.count() == 0


def test_it_refuses_past_the_tenant_backlog(client, write_key, tenant, demo):
    tenant.max_backlog = 3
    tenant.save()
    assert start(client, write_key, {}).status_code == 201  # 2 tasks unfinished
    response = start(client, write_key, {})  # +2 would make 4 > 3
    assert response.status_code == 429
    detail = response.json()["detail"]
    assert "2 unfinished task(s)" in detail and "max_backlog of 3" in detail
    assert WorkflowExecution.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_finished_tasks_free_the_backlog(client, write_key, tenant, demo):
    tenant.max_backlog = 2
    tenant.save()
    first = start(client, write_key, {}).json()["id"]
    assert start(client, write_key, {}).status_code == 429
    run_task(first, "a", outcome="success", output={})
    run_task(first, "b", outcome="success", output={})
    assert start(client, write_key, {}).status_code == 201


# --- inspect ----------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_it_shows_the_final_context_and_errors_once_terminal(client, write_key, read_key, demo):
    execution_id = start(client, write_key, {"context": {"x": 1}}).json()["id"]
    run_task(execution_id, "a", outcome="success", output={"a": 1, "x": 2})
    running = get(client, read_key, f"/executions/{execution_id}").json()
    assert running["status"] == "Running" and running["context"] is None
    run_task(execution_id, "b", outcome="failure", error_type="KeyError", error_message="'y'")
    detail = get(client, read_key, f"/executions/{execution_id}").json()
    assert detail["status"] == "Failed"
    assert detail["context"] == {"x": 2, "a": 1}
    assert detail["error"] == "task(s) failed: b"
    tasks = {t["task_id"]: t for t in detail["tasks"]}
    assert tasks["a"]["status"] == "Completed" and tasks["a"]["error"] is None
    assert tasks["b"]["error"] == "KeyError: 'y'" and tasks["b"]["attempt"] == 1
    assert tasks["b"]["agent"] is None and tasks["b"]["finished_at"] is not None


def test_another_tenants_execution_is_not_found(client, write_key, other_write_key, demo):
    execution_id = start(client, write_key, {}).json()["id"]
    assert get(client, other_write_key, f"/executions/{execution_id}").status_code == 404
    response = client.post(f"/api/v1/executions/{execution_id}/cancel", **bearer(other_write_key))
    assert response.status_code == 404
    assert WorkflowExecution.objects.get().status == "Pending"
    assert get(client, other_write_key, "/executions").json()["count"] == 0


def test_unknown_and_malformed_ids(client, read_key):
    assert get(client, read_key, f"/executions/{uuid.uuid4()}").status_code == 404
    response = get(client, read_key, "/executions/not-a-uuid")
    assert response.status_code == 422
    assert "UUID" in response.json()["detail"]  # says what an id must look like


def test_it_lists_newest_first_with_a_status_filter_and_pages(client, write_key, read_key, demo):
    ids = [start(client, write_key, {}).json()["id"] for _ in range(3)]
    client.post(f"/api/v1/executions/{ids[0]}/cancel", **bearer(write_key))
    page = get(client, read_key, "/executions?limit=2").json()
    assert page["count"] == 3 and [i["id"] for i in page["items"]] == [ids[2], ids[1]]
    rest = get(client, read_key, "/executions?limit=2&offset=2").json()
    assert [i["id"] for i in rest["items"]] == [ids[0]]
    cancelled = get(client, read_key, "/executions?status=Cancelled").json()
    assert [i["id"] for i in cancelled["items"]] == [ids[0]]
    bad = get(client, read_key, "/executions?status=Done")
    assert bad.status_code == 422 and "Cancelled" in bad.json()["detail"]  # lists the valid ones


# --- cancel -----------------------------------------------------------------------------


def test_cancel_skips_unstarted_tasks_and_is_409_when_terminal(client, write_key, read_key, demo):
    execution_id = start(client, write_key, {}).json()["id"]
    assert (
        client.post(f"/api/v1/executions/{execution_id}/cancel", **bearer(read_key)).status_code
        == 403
    )
    response = client.post(f"/api/v1/executions/{execution_id}/cancel", **bearer(write_key))
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "Cancelled"
    assert {t["status"] for t in body["tasks"]} == {"Skipped"}
    again = client.post(f"/api/v1/executions/{execution_id}/cancel", **bearer(write_key))
    assert again.status_code == 409
    assert "already Cancelled" in again.json()["detail"]
