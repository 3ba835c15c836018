"""The ASGI application's HTTP handler (cloacina_site/one_hop.py): sync views get the
whole middleware chain in one hop to the sync thread, async views Django's async chain;
both through the real ASGI application, every middleware still in place."""

from __future__ import annotations

import json
import uuid

import pytest
from channels.testing import HttpCommunicator

from cloacina_site import asgi
from cloacina_site.one_hop import is_async_view
from tests.support.loop import run_async

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def hops(monkeypatch) -> list[str]:
    """The paths the handler sent through its one hop."""
    seen: list[str] = []
    handler = asgi.django_asgi_app
    one_hop = handler.one_hop

    async def counting(request):
        seen.append(request.path)
        return await one_hop(request)

    monkeypatch.setattr(handler, "one_hop", counting)
    return seen


def call(method: str, path: str, key: str | None = None, body: bytes = b"") -> dict:
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    if body:
        headers.append((b"content-type", b"application/json"))
    communicator = HttpCommunicator(asgi.application, method, path, body, headers)
    return run_async(communicator.get_response())


def header(response: dict, name: bytes) -> str | None:
    return next((v.decode() for k, v in response["headers"] if k.lower() == name), None)


def test_it_tells_async_views_from_sync_ones():
    assert is_async_view(f"/api/v1/agents/{uuid.uuid4()}/results")
    assert not is_async_view(f"/api/v1/executions/{uuid.uuid4()}")
    assert not is_async_view("/console/")
    assert not is_async_view("/no/such/page")


def test_a_sync_view_runs_in_one_hop_with_every_middleware(hops, read_key):
    response = call("GET", "/api/v1/executions", read_key)
    assert response["status"] == 200
    assert json.loads(response["body"])["count"] == 0
    assert hops == ["/api/v1/executions"]
    # The middleware ran: security headers, clickjacking, the request guard.
    assert header(response, b"x-content-type-options") == "nosniff"
    assert header(response, b"x-frame-options") == "DENY"
    refused = call("GET", "/api/v1/executions%00", read_key)
    assert refused["status"] == 400


def test_an_async_view_keeps_djangos_async_chain(hops):
    response = call("POST", f"/api/v1/agents/{uuid.uuid4()}/results", body=b"{}")
    assert response["status"] == 401  # the async view's own authentication answered
    assert "Authorization" in json.loads(response["body"])["detail"]
    assert hops == []


def test_csrf_and_login_still_guard_the_console(hops):
    page = call("GET", "/console/")
    assert page["status"] == 302 and "/login" in header(page, b"location")
    posted = call("POST", "/console/login/", body=b"{}")
    assert posted["status"] == 403  # no CSRF token: refused by the CSRF middleware
    assert hops == ["/console/", "/console/login/"]
