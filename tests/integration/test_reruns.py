"""Re-run and retry over REST (fleet/api/reruns.py, fleet/engine/reruns.py).

Re-run: a new execution of the same package version, the same or an edited input,
linked both ways and recorded (who, when).  Retry: a Failed execution re-opened in
place from its failed tasks, completed ones keeping their outputs.  Bad requests
(not finished, nothing failed, another tenant's, bad context, over the backlog) are
4xx with a detail, and change nothing.
"""

from __future__ import annotations

import json
import uuid

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from artifacts.store.testing import build_archive, package_files
from fleet.engine import ready_queue
from fleet.models import ExecutionLink, TaskExecution, WorkflowExecution
from fleet.platform.config import apply_overrides, reset_config
from tests.support.keys import bearer

pytestmark = pytest.mark.django_db(transaction=True)

SOURCE = """
def a(context):
    return {"a": context.get("x", 0) + 1}


def b(context):
    if context.get("fail"):
        raise RuntimeError("b was told to fail")
    return {"b": context["a"] * 10}
"""


@pytest.fixture
def client() -> Client:
    return Client()


def upload(client: Client, key: str, version: str = "1.0.0", retries: int = 0) -> None:
    tasks = [
        {"id": "a", "function": "demo.steps:a"},
        {"id": "b", "function": "demo.steps:b", "dependencies": ["a"], "retries": retries},
    ]
    data = build_archive(package_files(tasks, SOURCE, version=version))
    response = client.post(
        "/api/v1/packages", {"file": SimpleUploadedFile("demo.tar.gz", data)}, **bearer(key)
    )
    assert response.status_code == 201, response.content


@pytest.fixture
def demo(client, write_key) -> str:
    upload(client, write_key)
    return "demo"


@pytest.fixture
def submitted():
    events = []
    ready_queue.register(events.extend)
    yield events
    ready_queue.register(None)


def post(client: Client, key: str, path: str, body: object = None):
    if body is None:
        return client.post(f"/api/v1{path}", **bearer(key))
    return client.post(
        f"/api/v1{path}", data=json.dumps(body), content_type="application/json", **bearer(key)
    )


def get(client: Client, key: str, execution_id) -> dict:
    response = client.get(f"/api/v1/executions/{execution_id}", **bearer(key))
    assert response.status_code == 200, response.content
    return response.json()


def run(execution_id, task_name: str, **report) -> None:
    """Claim the task and apply an outcome through the one result handler."""
    from tests.support.factories import finish

    task = TaskExecution.objects.get(workflow_execution_id=execution_id, task_name=task_name)
    finish(task, **report)


def started(client: Client, key: str, context: dict) -> str:
    response = post(client, key, "/workflows/demo/executions", {"context": context})
    assert response.status_code == 201, response.content
    return response.json()["id"]


def completed(client: Client, key: str, context: dict | None = None) -> str:
    execution_id = started(client, key, context or {"x": 1})
    run(execution_id, "a", outcome="success", output={"a": 2})
    run(execution_id, "b", outcome="success", output={"b": 20})
    return execution_id


def failed(client: Client, key: str) -> str:
    execution_id = started(client, key, {"x": 1})
    run(execution_id, "a", outcome="success", output={"a": 2})
    run(execution_id, "b", outcome="failure", error_type="RuntimeError", error_message="boom")
    assert WorkflowExecution.objects.get(pk=execution_id).status == "Failed"
    return execution_id


def state() -> tuple:
    """Everything a refused request must leave as it was."""
    return (
        sorted(WorkflowExecution.objects.values_list("id", "status", "error", "open_tasks")),
        sorted(
            TaskExecution.objects.values_list(
                "id", "status", "attempt", "max_retries", "output_context"
            )
        ),
        ExecutionLink.objects.count(),
    )


# --- re-run -----------------------------------------------------------------------------


def test_rerun_starts_the_same_package_version_with_the_same_input_linked_both_ways(
    client, write_key, read_key, demo, submitted
):
    source_id = completed(client, write_key, {"x": 1})
    submitted.clear()
    response = post(client, write_key, f"/executions/{source_id}/rerun")
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["status"] == "Pending" and body["rerun_of"] == source_id
    new_id = body["id"]
    assert new_id != source_id
    source, new = (WorkflowExecution.objects.get(pk=i) for i in (source_id, new_id))
    assert new.package_id == source.package_id and new.input_context == {"x": 1}
    assert [(e.workflow_execution_id, e.task_name) for e in submitted] == [(new.pk, "a")]

    derived = get(client, read_key, new_id)
    assert derived["rerun_of"] == source_id and derived["reruns"] == []
    original = get(client, read_key, source_id)
    assert original["rerun_of"] is None
    [link] = original["reruns"]
    assert link["id"] == new_id and link["context_edited"] is False
    assert link["actor"].startswith("write key ") and link["at"]


def test_rerun_with_an_edited_context(client, write_key, read_key, demo):
    source_id = completed(client, write_key, {"x": 1})
    response = post(client, write_key, f"/executions/{source_id}/rerun", {"context": {"x": 5}})
    assert response.status_code == 201, response.content
    new = WorkflowExecution.objects.get(pk=response.json()["id"])
    assert new.input_context == {"x": 5}
    assert get(client, read_key, source_id)["reruns"][0]["context_edited"] is True
    # An empty body object means "the same input", like no body at all.
    again = post(client, write_key, f"/executions/{source_id}/rerun", {})
    assert WorkflowExecution.objects.get(pk=again.json()["id"]).input_context == {"x": 1}


def test_rerun_keeps_the_version_the_source_ran_even_once_superseded(client, write_key, demo):
    source_id = completed(client, write_key)
    upload(client, write_key, version="2.0.0")
    response = post(client, write_key, f"/executions/{source_id}/rerun")
    assert response.status_code == 201
    new = WorkflowExecution.objects.select_related("package").get(pk=response.json()["id"])
    assert new.package.version == "1.0.0" and new.package.superseded
    fresh = started(client, write_key, {})
    assert WorkflowExecution.objects.get(pk=fresh).package.version == "2.0.0"


def test_rerun_of_failed_and_cancelled_executions(client, write_key, demo):
    failed_id = failed(client, write_key)
    assert post(client, write_key, f"/executions/{failed_id}/rerun").status_code == 201
    cancelled_id = started(client, write_key, {})
    post(client, write_key, f"/executions/{cancelled_id}/cancel")
    assert post(client, write_key, f"/executions/{cancelled_id}/rerun").status_code == 201


def test_rerun_of_an_unfinished_execution_is_409_and_changes_nothing(client, write_key, demo):
    running = started(client, write_key, {})
    before = state()
    response = post(client, write_key, f"/executions/{running}/rerun")
    assert response.status_code == 409
    assert "Pending" in response.json()["detail"] and "finished" in response.json()["detail"]
    assert state() == before


@pytest.mark.parametrize(
    ("context", "wording"), [([1, 2], "object"), ("text", "object"), (3, "object")]
)
def test_rerun_refuses_a_context_that_is_not_an_object(client, write_key, demo, context, wording):
    source_id = completed(client, write_key)
    before = state()
    response = post(client, write_key, f"/executions/{source_id}/rerun", {"context": context})
    assert response.status_code == 422
    assert wording in response.json()["detail"]
    assert state() == before


def test_rerun_refuses_an_oversized_context(client, write_key, demo):
    source_id = completed(client, write_key)
    before = state()
    apply_overrides(max_context_bytes=64)
    try:
        response = post(
            client, write_key, f"/executions/{source_id}/rerun", {"context": {"x": "y" * 100}}
        )
    finally:
        reset_config()
    assert response.status_code == 422 and "64-byte limit" in response.json()["detail"]
    assert state() == before


def test_rerun_over_the_backlog_is_429(client, write_key, tenant, demo):
    source_id = completed(client, write_key)
    started(client, write_key, {})
    tenant.max_backlog = 3
    tenant.save()
    before = state()
    response = post(client, write_key, f"/executions/{source_id}/rerun")
    assert response.status_code == 429 and "max_backlog" in response.json()["detail"]
    assert state() == before


# --- retry ------------------------------------------------------------------------------


def test_retry_reopens_the_failed_execution_and_completed_tasks_keep_their_outputs(
    client, write_key, read_key, demo, submitted
):
    execution_id = failed(client, write_key)
    a_before = TaskExecution.objects.get(workflow_execution_id=execution_id, task_name="a")
    submitted.clear()
    response = post(client, write_key, f"/executions/{execution_id}/retry")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body == {"id": execution_id, "status": "Running", "retried_tasks": ["b"]}
    assert [(e.task_name, e.attempt) for e in submitted] == [("b", 2)]

    execution = WorkflowExecution.objects.get(pk=execution_id)
    assert execution.error == "" and execution.finished_at is None and execution.open_tasks == 1
    a = TaskExecution.objects.get(pk=a_before.pk)
    assert (a.status, a.output_context, a.attempt, a.finished_at) == (
        "Completed", {"a": 2}, 1, a_before.finished_at
    )  # fmt: skip
    b = TaskExecution.objects.get(workflow_execution_id=execution_id, task_name="b")
    assert (b.status, b.attempt, b.max_retries, b.error_type) == ("Ready", 1, 1, "")

    run(execution_id, "b", outcome="success", output={"b": 20})
    detail = get(client, read_key, execution_id)
    assert detail["status"] == "Completed" and detail["error"] is None
    assert detail["context"] == {"x": 1, "a": 2, "b": 20}
    assert {t["task_id"]: t["attempt"] for t in detail["tasks"]} == {"a": 1, "b": 2}
    [retry] = detail["retries"]
    assert retry["tasks"] == ["b"] and retry["previous_error"] == "task(s) failed: b"
    assert retry["actor"].startswith("write key ")
    assert detail["rerun_of"] is None and detail["reruns"] == []


def test_retry_renews_the_manifests_retry_budget(client, write_key, demo):
    upload(client, write_key, version="1.1.0", retries=1)
    execution_id = started(client, write_key, {})
    run(execution_id, "a", outcome="success", output={"a": 1})
    for _ in range(2):  # attempt 1 fails and is retried by the manifest; attempt 2 fails for good
        TaskExecution.objects.filter(workflow_execution_id=execution_id, task_name="b").update(
            ready_at=None
        )  # the backoff is not what is under test
        run(execution_id, "b", outcome="failure", error_type="E", error_message="x")
    assert WorkflowExecution.objects.get(pk=execution_id).status == "Failed"
    assert post(client, write_key, f"/executions/{execution_id}/retry").status_code == 200
    b = TaskExecution.objects.get(workflow_execution_id=execution_id, task_name="b")
    assert (b.attempt, b.max_retries) == (2, 3)  # two more runs: the manifest's 1 retry again
    run(execution_id, "b", outcome="failure", error_type="E", error_message="x")
    b.refresh_from_db()
    assert b.status == "Ready" and b.attempt == 3  # retried by the renewed budget


def test_retry_of_a_failed_root_decides_the_skipped_tasks_again(client, write_key, demo):
    execution_id = started(client, write_key, {})
    run(execution_id, "a", outcome="failure", error_type="E", error_message="root")
    statuses = dict(
        TaskExecution.objects.filter(workflow_execution_id=execution_id).values_list(
            "task_name", "status"
        )
    )
    assert statuses == {"a": "Failed", "b": "Skipped"}
    response = post(client, write_key, f"/executions/{execution_id}/retry")
    assert response.json()["retried_tasks"] == ["a", "b"]
    run(execution_id, "a", outcome="success", output={"a": 1})
    run(execution_id, "b", outcome="success", output={"b": 10})
    assert WorkflowExecution.objects.get(pk=execution_id).status == "Completed"


@pytest.mark.parametrize("make", ["completed", "running", "cancelled"])
def test_retry_is_409_unless_failed_and_changes_nothing(client, write_key, demo, make):
    if make == "completed":
        execution_id = completed(client, write_key)
    else:
        execution_id = started(client, write_key, {})
        if make == "cancelled":
            post(client, write_key, f"/executions/{execution_id}/cancel")
    before = state()
    response = post(client, write_key, f"/executions/{execution_id}/retry")
    assert response.status_code == 409
    assert "only a Failed execution can be retried" in response.json()["detail"]
    assert state() == before


def test_retry_with_nothing_failed_is_409(client, write_key, demo):
    execution_id = failed(client, write_key)
    TaskExecution.objects.filter(workflow_execution_id=execution_id).update(status="Completed")
    before = state()
    response = post(client, write_key, f"/executions/{execution_id}/retry")
    assert response.status_code == 409 and "no task failed" in response.json()["detail"]
    assert state() == before


def test_retry_over_the_backlog_is_429_and_changes_nothing(client, write_key, tenant, demo):
    execution_id = failed(client, write_key)
    started(client, write_key, {})
    tenant.max_backlog = 2
    tenant.save()
    before = state()
    response = post(client, write_key, f"/executions/{execution_id}/retry")
    assert response.status_code == 429
    assert state() == before


def test_a_second_retry_while_the_first_runs_is_409(client, write_key, demo):
    execution_id = failed(client, write_key)
    assert post(client, write_key, f"/executions/{execution_id}/retry").status_code == 200
    before = state()
    assert post(client, write_key, f"/executions/{execution_id}/retry").status_code == 409
    assert state() == before


# --- who may ----------------------------------------------------------------------------


@pytest.mark.parametrize("action", ["rerun", "retry"])
def test_a_read_key_may_not_and_another_tenant_gets_404(
    client, write_key, read_key, other_write_key, demo, action
):
    execution_id = failed(client, write_key)
    before = state()
    assert post(client, read_key, f"/executions/{execution_id}/{action}").status_code == 403
    other = post(client, other_write_key, f"/executions/{execution_id}/{action}")
    missing = post(client, other_write_key, f"/executions/{uuid.uuid4()}/{action}")
    assert other.status_code == missing.status_code == 404
    assert state() == before
    assert post(client, write_key, "/executions/not-a-uuid/" + action).status_code == 422
