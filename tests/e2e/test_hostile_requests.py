"""Hostile requests against a real `serve`: a 50 MB context, a context just over its
limit, NUL characters and lone surrogates, numbers past their columns, bodies that are
not objects.  Each gets a clear 4xx JSON error naming the problem, nothing is stored, and
the server keeps serving.  (Several of these were 500s the API fuzzer found.)
"""

from __future__ import annotations

import json

import httpx
import pytest

from artifacts.store.testing import example_archive

pytestmark = pytest.mark.e2e

MB = 1024 * 1024


def _executions() -> int:
    from fleet.models import WorkflowExecution

    return WorkflowExecution.objects.count()


def _start(served, body: bytes | str, workflow: str = "etl"):
    return served.post(
        f"/workflows/{workflow}/executions",
        content=body,
        headers={"Content-Type": "application/json"},
    )


@pytest.fixture
def with_package(served):
    response = served.post("/packages", files={"file": ("etl.tar.gz", example_archive())})
    assert response.status_code == 201, response.text
    return served


def test_a_50_mb_context_is_a_413_and_starts_nothing(with_package):
    served = with_package
    body = json.dumps({"context": {"blob": "x" * (50 * MB)}})
    before = served.rss_mb()
    response = _start(served, body)
    assert response.status_code == 413, response.text[:300]
    detail = response.json()["detail"]
    assert f"{len(body)} bytes" in detail and "the limit is" in detail
    assert _executions() == 0
    print(f"\nserver memory: {before:.0f} MB before, {served.rss_mb():.0f} MB after a 50 MB body")
    served.assert_still_serving()


def test_a_context_just_over_its_limit_is_a_422_and_starts_nothing(with_package):
    from fleet.platform.config import get_config

    served = with_package
    limit = get_config().max_context_bytes
    response = _start(served, json.dumps({"context": {"blob": "x" * limit}}))
    assert response.status_code == 422, response.text[:300]
    assert f"over the {limit}-byte limit" in response.json()["detail"]
    assert _executions() == 0
    served.assert_still_serving()


# (path, body or None for GET, status, words the detail must contain)
REQUESTS = [
    ("/workflows/a%00b/executions", "{}", 400, "NUL character"),
    ("/executions?status=%00", None, 400, "NUL character"),
    ("/workflows/etl/executions", '{"context": {"a": "\\u0000"}}', 422, "NUL character"),
    ("/workflows/etl/executions", '{"context": {"\\u0000": 1}}', 422, "NUL character"),
    ("/workflows/etl/executions", '{"context": {"a": "\\ud800"}}', 422, "lone surrogate"),
    ("/workflows/etl/executions", '{"context": {"a": NaN}}', 422, "not valid JSON"),
    ("/workflows/etl/executions", '{"context": {"a": Infinity}}', 422, "not valid JSON"),
    ("/workflows/etl/executions", '{"context": [1, 2]}', 422, "must be a JSON object"),
    ("/workflows/etl/executions", "[null, null]", 422, "must be a JSON object, not an array"),
    ("/workflows/etl/executions", "5", 422, "must be a JSON object, not a number"),
    ("/workflows/etl/executions", '{"context": ', 400, "not valid JSON"),
    ("/workflows/etl/executions", '{"priority": 100000000000000000000}', 422, "priority"),
    ("/workflows/etl/executions", '{"priority": true}', 422, "priority: must be an integer"),
    ("/workflows/etl/executions", "[" * 100_000 + "]" * 100_000, 400, "Cannot parse"),
    ("/executions?offset=100000000000000000000", None, 422, "offset"),
    ("/fleet/history?limit=100000000000000000000", None, 422, "limit"),
]


def test_hostile_requests_are_clear_4xx_and_change_nothing(with_package):
    served = with_package
    wrong = []
    for path, body, status, words in REQUESTS:
        if body is None:
            response = served.get(path)
        else:
            headers = {"Content-Type": "application/json"}
            response = served.post(path, content=body, headers=headers)
        json_error = response.headers["content-type"].startswith("application/json")
        detail = response.json().get("detail", "") if json_error else response.text[:200]
        if response.status_code != status or not json_error or words not in detail:
            wrong.append((path, (body or "")[:60], response.status_code, detail))
    assert not wrong, "\n".join(map(str, wrong))
    assert _executions() == 0
    served.assert_still_serving()


def test_an_admin_number_past_its_column_is_a_422(served):
    from fleet.models import ApiKey, Tenant

    admin = ApiKey.mint("admin")[1]
    for body in ({"max_agents_override": 10**20}, {"desired_count": 10**9}):
        response = httpx.put(
            served.server.api("/admin/tenants/acme/fleet"),
            json=body,
            headers={"Authorization": f"Bearer {admin}"},
            timeout=10,
        )
        assert response.status_code == 422, response.text
        assert "at most" in response.json()["detail"]
    tenant = Tenant.objects.get(name="acme")
    assert (tenant.max_agents_override, tenant.desired_count) == (None, 0)
    served.assert_still_serving()


@pytest.mark.django_db
def test_a_database_restart_is_a_503_with_retry_after(read_key, monkeypatch):
    """What a client sees while PostgreSQL is away (the chaos run restarts it for real)."""
    from django.db.utils import OperationalError
    from django.test import Client

    from fleet.api import fleet_status
    from tests.support.keys import bearer

    def away(*_args):  # fleet_view(tenant, filter, limit, offset)
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(fleet_status, "fleet_view", away)
    response = Client().get("/api/v1/fleet", **bearer(read_key))
    assert response.status_code == 503
    assert response.json() == {"detail": "the database is unavailable; retry shortly"}
    assert response["Retry-After"] == "1"
