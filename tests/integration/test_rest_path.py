"""The REST path users poll (issue 17 item 4): start and get an execution cheaply.

* the number of queries per request is bounded, and does not grow with the task count;
* GET /executions/{id} (one statement, fleet/api/execution_view.py) answers what the ORM
  path answers;
* a verified key is reused for a few seconds (fleet/platform/key_cache.py), yet a key
  revoked or a tenant deactivated in this process is refused at once, and one revoked by
  another process (no signal here) within the TTL.
"""

from __future__ import annotations

import json

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from agents.models import Agent
from artifacts.models import WorkflowPackage
from artifacts.store.queries import active_package
from artifacts.store.testing import build_archive, manifest_toml
from fleet.control import limits
from fleet.executors.fleet.lifecycle import revoke_key
from fleet.models import ApiKey, ExecutionLink, TaskExecution, Tenant
from fleet.platform import key_cache
from fleet.platform.config import apply_overrides, reset_config
from tests.support.keys import bearer
from tests.support.packages import upload
from tests.support.waiting import wait_until

pytestmark = pytest.mark.django_db

# Upper bounds, with the key already verified once (the cache warm): a regression fails here.
GET_QUERIES = 1  # the execution with its tasks and their agents, in one statement
START_QUERIES = 1  # the active package read, the execution and its tasks written: one statement
BACKLOG_START_QUERIES = 3  # with a backlog limit: the active package, the backlog count, the insert


@pytest.fixture(autouse=True)
def fresh_cache():
    key_cache.clear()
    yield
    key_cache.clear()
    reset_config()


@pytest.fixture
def client() -> Client:
    return Client()


def wide_package(client: Client, key: str, workflow: str, width: int) -> None:
    tasks = [{"id": f"t{i:02d}", "function": "steps:noop"} for i in range(width)]
    files = {
        "cloacina.toml": manifest_toml(tasks, name=workflow.replace("_", "-"), workflow=workflow),
        "workflow/steps.py": "def noop(context):\n    return None\n",
    }
    response = upload(client, key, build_archive(files))
    assert response.status_code == 201, response.content


def start(client: Client, key: str, workflow: str, context: dict | None = None):
    return client.post(
        f"/api/v1/workflows/{workflow}/executions",
        data=json.dumps({"context": context or {}}),
        content_type="application/json",
        **bearer(key),
    )


def get(client: Client, key: str, execution_id: str):
    return client.get(f"/api/v1/executions/{execution_id}", **bearer(key))


def queries(call) -> tuple[object, list[str]]:
    with CaptureQueriesContext(connection) as captured:
        response = call()
    return response, [q["sql"] for q in captured.captured_queries]


# --- queries per request ------------------------------------------------------------------


@pytest.mark.parametrize("width", [3, 30])
def test_a_get_is_one_query_whatever_the_task_count(client, write_key, width):
    wide_package(client, write_key, "wide", width)
    execution_id = start(client, write_key, "wide").json()["id"]
    response, sql = queries(lambda: get(client, write_key, execution_id))
    assert response.status_code == 200 and len(response.json()["tasks"]) == width
    assert len(sql) <= GET_QUERIES, sql


def test_starting_an_execution_is_one_statement(client, write_key):
    wide_package(client, write_key, "wide", 10)
    assert start(client, write_key, "wide").status_code == 201  # the key verified, last use kept
    response, sql = queries(lambda: start(client, write_key, "wide"))
    assert response.status_code == 201
    assert len(sql) <= START_QUERIES, sql
    assert TaskExecution.objects.filter(workflow_execution_id=response.json()["id"]).count() == 10


def test_a_start_hands_its_roots_to_the_dispatch_loop_and_answers_pending(
    client, write_key, monkeypatch
):
    from fleet.engine import ready_queue

    wide_package(client, write_key, "wide", 4)
    submitted = []
    monkeypatch.setattr(ready_queue, "submit", submitted.extend)
    response = client.post(
        "/api/v1/workflows/wide/executions",
        data=json.dumps({"context": {"k": 1}, "priority": 7}),
        content_type="application/json",
        **bearer(write_key),
    )
    assert response.status_code == 201 and response.json()["status"] == "Pending"
    tasks = TaskExecution.objects.filter(workflow_execution_id=response.json()["id"])
    assert (
        sorted((e.task_execution_id, e.task_name, e.priority) for e in submitted)
        == sorted((t.id, t.task_name, 7) for t in tasks if t.status == "Ready")
        and len(submitted) == 4
    )
    assert {e.workflow_execution_id for e in submitted} == {tasks[0].workflow_execution_id}
    response = start(client, write_key, "no_such_workflow")
    assert response.status_code == 404 and response.json() == {
        "detail": "no active package provides workflow 'no_such_workflow' in this tenant"
    }


def test_a_start_answers_what_ninja_renders_without_its_response_round(
    client, write_key, monkeypatch
):
    from cloacina_site.api import api

    wide_package(client, write_key, "wide", 2)
    apply_overrides(max_backlog=1000)  # the backlog path: ninja validates and renders StartOut
    rendered = start(client, write_key, "wide")
    reset_config()

    def no_ninja_rendering(*args, **kwargs):
        raise AssertionError("the one-statement start went through ninja's response round")

    monkeypatch.setattr(api, "create_response", no_ninja_rendering)
    response = start(client, write_key, "wide")
    assert response.status_code == rendered.status_code == 201
    assert response["Content-Type"] == rendered["Content-Type"]
    other_id = rendered.json()["id"]
    assert response.content == rendered.content.replace(
        other_id.encode(), response.json()["id"].encode()
    )
    assert TaskExecution.objects.filter(workflow_execution_id=response.json()["id"]).count() == 2


def test_with_a_backlog_limit_a_start_reads_the_active_package_once(client, write_key):
    apply_overrides(max_backlog=1000)
    wide_package(client, write_key, "wide", 10)
    assert start(client, write_key, "wide").status_code == 201
    response, sql = queries(lambda: start(client, write_key, "wide"))
    assert response.status_code == 201
    assert len(sql) <= BACKLOG_START_QUERIES, sql
    assert sum(f"FROM {WorkflowPackage._meta.db_table}" in q for q in sql) == 1, sql
    apply_overrides(max_backlog=10)
    response = start(client, write_key, "wide")
    assert response.status_code == 429 and "over the platform's" in response.json()["detail"]
    assert start(client, write_key, "no_such_workflow").status_code == 429  # counted first


def test_a_cold_key_costs_one_query_more(client, write_key, read_key):
    wide_package(client, write_key, "wide", 3)
    execution_id = start(client, write_key, "wide").json()["id"]
    _, cold = queries(lambda: get(client, read_key, execution_id))
    _, warm = queries(lambda: get(client, read_key, execution_id))
    assert len(warm) <= GET_QUERIES < len(cold)
    assert any("fleet_apikey" in sql for sql in cold)
    assert not any("fleet_apikey" in sql for sql in warm)


def test_with_the_cache_off_every_request_verifies_its_key(client, write_key):
    apply_overrides(auth_cache_ttl_s=0)
    wide_package(client, write_key, "wide", 3)
    execution_id = start(client, write_key, "wide").json()["id"]
    _, sql = queries(lambda: get(client, write_key, execution_id))
    assert sum("fleet_apikey" in s for s in sql) == 1


def test_the_active_package_is_loaded_as_the_orm_loads_it(client, write_key, tenant):
    wide_package(client, write_key, "wide", 2)
    found = active_package(tenant, "wide")
    expected = WorkflowPackage.objects.get(tenant=tenant, workflow_name="wide")
    fields = [f.attname for f in WorkflowPackage._meta.concrete_fields]
    assert [getattr(found, f) for f in fields] == [getattr(expected, f) for f in fields]
    assert found.task_names == expected.task_names == ["t00", "t01"]  # the manifest, parsed
    assert found._state.adding is False and found.get_deferred_fields() == set()
    assert active_package(tenant, "nope") is None


# --- what a GET answers ---------------------------------------------------------------------


def test_a_get_answers_what_the_orm_path_answers(client, write_key, tenant):
    wide_package(client, write_key, "wide", 3)
    execution_id = start(client, write_key, "wide", {"n": 1}).json()["id"]
    agent = Agent.objects.create(
        tenant=tenant, name="worker-1", target_triple="x86_64-unknown-linux-gnu"
    )
    # Running (so the cancel leaves them as they are), one on an agent, with errors.
    TaskExecution.objects.filter(workflow_execution_id=execution_id, task_name="t01").update(
        status="Running",
        agent=agent,
        started_at=timezone.now(),
        error_type="KeyError",
        error_message="'y'",
        wait_reason="because",
    )
    TaskExecution.objects.filter(workflow_execution_id=execution_id, task_name="t02").update(
        status="Running", error_message="no type"
    )
    # It was re-run from another execution, re-run itself once, and retried once.
    other = start(client, write_key, "wide").json()["id"]
    derived = start(client, write_key, "wide").json()["id"]
    link = {"tenant": tenant, "actor": "write key abc"}
    ExecutionLink.objects.create(
        kind="rerun", source_id=other, execution_id=execution_id, context_edited=True, **link
    )
    ExecutionLink.objects.create(kind="rerun", source_id=execution_id, execution_id=derived, **link)
    ExecutionLink.objects.create(
        kind="retry",
        source_id=execution_id,
        execution_id=execution_id,
        tasks=["t01"],
        previous_error="task(s) failed: t01",
        **link,
    )
    # Cancel answers through the ORM (fleet/api/executions.py: _execution_out); GET must
    # answer the same, field for field, in the same task order.
    cancelled = client.post(f"/api/v1/executions/{execution_id}/cancel", **bearer(write_key))
    assert cancelled.status_code == 200
    got = get(client, write_key, execution_id)
    assert got.status_code == 200
    assert got.json() == cancelled.json()
    tasks = got.json()["tasks"]
    assert [t["task_id"] for t in tasks] == ["t00", "t01", "t02"]
    assert tasks[1]["agent"] == "worker-1" and tasks[1]["error"] == "KeyError: 'y'"
    assert tasks[1]["started_at"].endswith("Z")  # the same timestamp format as elsewhere
    assert tasks[2]["error"] == "no type" and tasks[0]["error"] == "cancelled"
    assert got.json()["input_context"] == {"n": 1}  # the final context: test_executions_api.py
    assert got.json()["rerun_of"] == other
    assert [r["id"] for r in got.json()["reruns"]] == [derived]
    assert got.json()["retries"][0]["tasks"] == ["t01"]


def test_a_running_execution_shows_no_final_context(client, write_key):
    wide_package(client, write_key, "wide", 1)
    execution_id = start(client, write_key, "wide", {"n": 1}).json()["id"]
    body = get(client, write_key, execution_id).json()
    assert body["context"] is None and body["input_context"] == {"n": 1}
    assert body["tasks"][0]["status"] == "Ready" and body["tasks"][0]["agent"] is None


def test_another_tenants_execution_is_still_not_found(client, write_key, other_write_key):
    wide_package(client, write_key, "wide", 1)
    execution_id = start(client, write_key, "wide").json()["id"]
    response = get(client, other_write_key, execution_id)
    assert response.status_code == 404
    assert response.json() == {"detail": f"execution {execution_id} not found"}


# --- the key cache and revocation ------------------------------------------------------------


def executions_list(client: Client, key: str) -> int:
    return client.get("/api/v1/executions", **bearer(key)).status_code


def test_a_key_revoked_in_this_process_is_refused_at_once(client, tenant):
    key, token = ApiKey.mint("read", tenant=tenant)
    assert executions_list(client, token) == 200  # verified and cached
    assert revoke_key(key)
    response = client.get("/api/v1/executions", **bearer(token))
    assert response.status_code == 401
    assert response.json() == {"detail": "invalid or revoked API key"}


@pytest.mark.parametrize("how", ["limits", "save"])
def test_a_tenant_deactivated_in_this_process_is_refused_at_once(client, tenant, read_key, how):
    assert executions_list(client, read_key) == 200
    if how == "limits":
        limits.set_tenant_limits(tenant, "admin:root", "offboarding", is_active=False)
    else:
        tenant.is_active = False
        tenant.save()
    assert executions_list(client, read_key) == 401


def test_a_deleted_key_is_refused_at_once(client, tenant):
    key, token = ApiKey.mint("read", tenant=tenant)
    assert executions_list(client, token) == 200
    key.delete()
    assert executions_list(client, token) == 401


def test_a_key_revoked_by_another_process_is_refused_within_the_ttl(client, tenant):
    apply_overrides(auth_cache_ttl_s=0.5)
    key, token = ApiKey.mint("read", tenant=tenant)
    assert executions_list(client, token) == 200
    # Another server process revokes it: a plain UPDATE here, no signal reaches this cache.
    ApiKey.objects.filter(pk=key.pk).update(revoked_at=timezone.now())
    assert executions_list(client, token) == 200  # this process learns it within the TTL
    wait_until(lambda: executions_list(client, token) == 401, timeout=5, what="the TTL to pass")


def test_an_agent_key_revoked_anywhere_is_refused_at_once(client, tenant):
    """Agent keys are not cached: a revoked agent loses its artifacts and results at once,
    whichever server process revoked the key (tests/e2e/test_secrets.py, across processes)."""
    key, token = ApiKey.mint("agent", tenant=tenant)
    url = f"/api/v1/artifacts/{'0' * 64}"
    assert client.get(url, **bearer(token)).status_code == 404  # authenticated: no such blob
    ApiKey.objects.filter(pk=key.pk).update(revoked_at=timezone.now())  # no signal here
    assert client.get(url, **bearer(token)).status_code == 401


def test_a_limit_changed_in_this_process_applies_to_the_next_start(client, write_key, tenant):
    wide_package(client, write_key, "wide", 2)
    assert start(client, write_key, "wide").status_code == 201  # the tenant is cached
    limits.set_tenant_limits(tenant, "admin:root", "tighter", max_backlog=3)
    refused = start(client, write_key, "wide")
    assert refused.status_code == 429 and "max_backlog of 3" in refused.json()["detail"]


def test_a_tenant_field_the_cache_does_not_hold_is_read_fresh(client, write_key, tenant):
    assert client.get("/api/v1/fleet/pools", **bearer(write_key)).status_code == 200
    Tenant.objects.filter(pk=tenant.pk).update(desired_count=3)  # not through this process
    response = client.get("/api/v1/fleet/pools", **bearer(write_key))
    assert response.json()["desired_count"] == 3


def test_a_wrong_token_is_not_cached(client, read_key):
    forged = read_key[:-4] + "abcd"
    assert executions_list(client, forged) == 401
    _, sql = queries(lambda: executions_list(client, forged))
    assert any("fleet_apikey" in s for s in sql)  # asked the database again
