"""The ASGI application's HTTP handler (cloacina_site/one_hop.py): sync views get the
whole middleware chain in one hop to the sync thread, async views Django's async chain,
the agents' own sync endpoints the sync chain on a delivery pool thread; all through the
real ASGI application, every middleware still in place."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import uuid
import weakref

import pytest
from channels.testing import HttpCommunicator
from django.db import DatabaseError, connection
from django.test import Client

from agents.models import Agent
from artifacts.store.testing import build_archive, manifest_toml
from cloacina_site import asgi, one_hop
from cloacina_site.one_hop import Route, is_async_view, route_of
from fleet.executors.fleet.delivery import db as delivery_db
from fleet.models import WorkflowExecution
from tests.support.loop import run_async
from tests.support.packages import upload
from tests.support.waiting import wait_until

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


@pytest.fixture
def pooled(monkeypatch) -> list[tuple[str, str]]:
    """The paths the handler ran on a delivery pool thread, and that thread's name."""
    seen: list[tuple[str, str]] = []
    handler = asgi.django_asgi_app

    async def counting(request):
        def run(request):
            seen.append((request.path, threading.current_thread().name))
            return handler.sync_handler.get_response(request)

        return await delivery_db.call(run, request)

    monkeypatch.setattr(handler, "pooled", counting)
    yield seen
    delivery_db.close()  # its threads' connections, before the test database goes


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


def test_it_sends_the_agents_sync_endpoints_to_the_delivery_pool():
    agent = uuid.uuid4()
    assert route_of("/api/v1/agents/register") is Route.POOLED
    assert route_of(f"/api/v1/agents/{agent}/heartbeat") is Route.ONE_HOP  # liveness: never queued
    assert route_of(f"/api/v1/agents/{agent}/deregister") is Route.POOLED
    assert route_of(f"/api/v1/agents/{agent}/drain") is Route.ONE_HOP
    assert route_of(f"/api/v1/agents/{agent}/results") is Route.ASYNC


def test_a_paths_route_is_resolved_once_per_url_conf(monkeypatch, settings):
    calls: list[tuple] = []
    real = one_hop.resolve

    def counted(path, urlconf=None):
        calls.append((path, urlconf))
        return real(path, urlconf)

    monkeypatch.setattr(one_hop, "resolve", counted)
    path = f"/api/v1/workflows/{uuid.uuid4().hex}/executions"  # a path no test routed before
    assert route_of(path) is route_of(path) is Route.POOLED
    assert calls == [(path, settings.ROOT_URLCONF)]  # the second answer was remembered
    settings.ROOT_URLCONF = "tests.support.empty_urls"  # another URL conf: its own answer
    assert route_of(path) is Route.ONE_HOP
    assert calls[1:] == [(path, "tests.support.empty_urls")]


def test_a_registration_runs_on_a_pool_thread_with_every_middleware(
    hops, pooled, agent_key, tenant
):
    body = {"name": "pooled-1", "target_triple": "x86_64-unknown-linux-gnu", "protocol_version": 1}
    response = call("POST", "/api/v1/agents/register", agent_key, json.dumps(body).encode())
    assert response["status"] == 201, response["body"]
    assert [path for path, _ in pooled] == ["/api/v1/agents/register"]
    assert pooled[0][1].startswith("delivery-db-")
    assert hops == []
    assert header(response, b"x-content-type-options") == "nosniff"
    assert header(response, b"x-frame-options") == "DENY"
    assert Agent.objects.get(tenant=tenant, name="pooled-1").state == "live"
    # Refusals are answered there too, as JSON naming the problem, and nothing is stored.
    refused = call("POST", "/api/v1/agents/register", agent_key, b'{"name": "x"}')
    assert refused["status"] == 422
    assert "target_triple" in refused["body"].decode()
    assert not Agent.objects.filter(name="x").exists()
    unknown = call("POST", f"/api/v1/agents/{uuid.uuid4()}/deregister", agent_key, b"")
    assert unknown["status"] == 404 and "detail" in json.loads(unknown["body"])
    assert [path for path, _ in pooled][-1].endswith("/deregister")


def test_at_most_a_few_pooled_requests_hold_a_pool_thread_at_once(monkeypatch):
    """A storm's registrations queue on the event loop, not on every delivery thread (the
    sockets' hellos and the results need them)."""
    handler = one_hop.OneHopASGIHandler()
    holding, peak, release = 0, 0, asyncio.Event()

    async def pool_call(fn, request):
        nonlocal holding, peak
        holding += 1
        peak = max(peak, holding)
        await release.wait()
        holding -= 1
        return request

    monkeypatch.setattr(delivery_db, "call", pool_call)

    async def storm() -> tuple[int, list]:
        calls = [
            asyncio.ensure_future(handler.pooled(n)) for n in range(3 * one_hop.POOLED_AT_ONCE)
        ]
        while holding < one_hop.POOLED_AT_ONCE:  # the first ones reach the pool
            await asyncio.sleep(0)
        for _ in range(10):  # the others had turns to get there too, and did not
            await asyncio.sleep(0)
        seen = peak
        release.set()
        return seen, await asyncio.gather(*calls)

    seen, answers = run_async(storm())
    assert seen == one_hop.POOLED_AT_ONCE
    assert answers == list(range(3 * one_hop.POOLED_AT_ONCE))  # every one answered, in turn


def test_a_killed_sync_request_gives_its_database_connection_back(monkeypatch):
    """daphne cancels the application of a request whose client went away; the view runs on
    in its thread and Django never sends request_finished for it.  The connection the view
    borrowed must still go back, or a storm of such requests drains the pool."""
    from django.db import connection
    from django.http import HttpResponse
    from django.test import RequestFactory

    handler = asgi.django_asgi_app
    in_view, finish = threading.Event(), threading.Event()
    used = []

    def slow_view(request):
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        used.append(connection)  # this request thread's connection
        in_view.set()
        finish.wait(10)
        return HttpResponse("too late")

    monkeypatch.setattr(handler.sync_handler, "get_response", slow_view)

    async def killed_request() -> None:
        request = asyncio.ensure_future(handler.one_hop(RequestFactory().get("/console/")))
        assert await asyncio.to_thread(in_view.wait, 10)
        request.cancel()  # what daphne does to an instance whose client went away
        finish.set()
        with pytest.raises(asyncio.CancelledError):
            await request

    run_async(killed_request())
    # The thread finishes the view after the cancellation, on its own time.
    wait_until(lambda: used[0].connection is None, timeout=5, what="the connection given back")


def test_a_pooled_request_starts_no_thread_and_sends_no_request_signal(
    pooled, agent_key, monkeypatch
):
    """Django's ASGI entry point starts an executor thread per request for its signal and
    close hops; a registration skips them (its only hop is to the pool), and the
    request_started receivers, which would close the pool thread's kept connection, do
    not run."""
    from django.core import signals

    run_async(delivery_db.call(Agent.objects.count))  # the pool's threads started
    started: list[str] = []
    real_start = threading.Thread.start

    def counting_start(thread: threading.Thread) -> None:
        if not thread.name.startswith("test-event-loop"):  # run_async's, not the server's
            started.append(thread.name)
        real_start(thread)

    signalled: list[str] = []

    def on_started(**kwargs) -> None:
        signalled.append("request_started")

    signals.request_started.connect(on_started)
    monkeypatch.setattr(threading.Thread, "start", counting_start)
    try:
        body = {"name": "no-thread", "target_triple": "x86_64-unknown-linux-gnu"}
        body["protocol_version"] = 1
        response = call("POST", "/api/v1/agents/register", agent_key, json.dumps(body).encode())
    finally:
        signals.request_started.disconnect(on_started)
    assert response["status"] == 201, response["body"]
    assert [path for path, _ in pooled][-1] == "/api/v1/agents/register"
    assert started == [] and signalled == []
    # Every other request still takes Django's own entry point (and its signals).
    signals.request_started.connect(on_started)
    try:
        assert call("GET", "/healthz")["status"] == 200
    finally:
        signals.request_started.disconnect(on_started)
    assert signalled == ["request_started"]


def test_a_pooled_request_whose_client_left_while_it_waited_never_runs(monkeypatch):
    """As under Django's own entry point: a registration whose client disconnected while it
    waited for a pool slot gives its turn up, and nothing is stored."""
    handler = one_hop.OneHopASGIHandler()
    ran: list[str] = []
    monkeypatch.setattr(
        delivery_db, "call", lambda fn, request: ran.append(request.path) or asyncio.sleep(0)
    )

    async def left() -> list[dict]:
        sent: list[dict] = []
        messages = asyncio.Queue()
        await messages.put({"type": "http.request", "body": b"{}", "more_body": False})

        async def send(message: dict) -> None:
            sent.append(message)

        async with handler.pooled_slots:  # every slot busy: the request waits
            for _ in range(one_hop.POOLED_AT_ONCE - 1):
                await handler.pooled_slots.acquire()
            scope = {
                "type": "http",
                "method": "POST",
                "path": "/api/v1/agents/register",
                "headers": [],
                "query_string": b"",
            }
            request = asyncio.ensure_future(handler(scope, messages.get, send))
            for _ in range(10):
                await asyncio.sleep(0)
            await messages.put({"type": "http.disconnect"})
            await request
            for _ in range(one_hop.POOLED_AT_ONCE - 1):
                handler.pooled_slots.release()
        return sent

    assert run_async(left()) == []
    assert ran == []


def _pooled_scope() -> dict:
    return {
        "type": "http",
        "method": "POST",
        "path": "/api/v1/agents/register",
        "headers": [],
        "query_string": b"",
    }


@pytest.mark.parametrize("who", ["client", "server"])
def test_a_pooled_request_stopped_while_it_runs(monkeypatch, who):
    """The client leaves while its request runs on a pool thread: nothing is sent and the
    application ends normally (the watcher's cancellation is answered, not left pending).
    The server kills the application (daphne's cancel): the cancellation propagates."""
    handler = one_hop.OneHopASGIHandler()

    async def stopped() -> tuple[list[dict], bool, int]:
        running = asyncio.Event()
        finish = asyncio.get_running_loop().create_future()

        async def on_pool_thread(fn, request):
            running.set()
            return await asyncio.shield(finish)  # runs to its end whatever happens

        monkeypatch.setattr(delivery_db, "call", on_pool_thread)
        sent: list[dict] = []
        messages = asyncio.Queue()
        await messages.put({"type": "http.request", "body": b"{}", "more_body": False})

        async def send(message: dict) -> None:
            sent.append(message)

        request = asyncio.ensure_future(handler(_pooled_scope(), messages.get, send))
        await running.wait()
        if who == "client":
            await messages.put({"type": "http.disconnect"})
        else:
            request.cancel()
        for _ in range(10):
            await asyncio.sleep(0)
        finish.set_result(None)
        await asyncio.gather(request, return_exceptions=True)
        return sent, request.cancelled(), request.cancelling()

    sent, cancelled, cancelling = run_async(stopped())
    assert sent == []
    assert cancelled is (who == "server")
    assert cancelling == (1 if who == "server" else 0)


def test_a_users_start_and_poll_run_on_a_pool_thread(hops, pooled, write_key, tenant):
    """A burst's requests (start an execution, poll it) take the pooled route, middleware
    and all; the start is committed before its 201, and its refusals are answered there."""
    assert route_of("/api/v1/workflows/w/executions") is Route.POOLED
    assert route_of(f"/api/v1/executions/{uuid.uuid4()}") is Route.POOLED
    assert route_of("/api/v1/executions") is Route.ONE_HOP  # the list is not a hot path
    tasks = [{"id": "a", "function": "steps:noop"}, {"id": "b", "function": "steps:noop"}]
    files = {
        "cloacina.toml": manifest_toml(tasks, name="pooled-start", workflow="pooled_start"),
        "workflow/steps.py": "def noop(context):\n    return None\n",
    }
    assert upload(Client(), write_key, build_archive(files)).status_code == 201
    body = json.dumps({"context": {"n": 1}}).encode()
    started = call("POST", "/api/v1/workflows/pooled_start/executions", write_key, body)
    assert started["status"] == 201, started["body"]
    execution_id = json.loads(started["body"])["id"]
    # Committed by the time the client has its answer: another connection sees it.
    assert WorkflowExecution.objects.get(pk=execution_id).tasks.count() == 2
    polled = call("GET", f"/api/v1/executions/{execution_id}", write_key)
    assert polled["status"] == 200
    assert {t["task_id"] for t in json.loads(polled["body"])["tasks"]} == {"a", "b"}
    assert header(polled, b"x-content-type-options") == "nosniff"
    unknown = call("POST", "/api/v1/workflows/nope/executions", write_key, body)
    assert unknown["status"] == 404 and "nope" in json.loads(unknown["body"])["detail"]
    bad = call("POST", "/api/v1/workflows/pooled_start/executions", write_key, b'{"context": 1}')
    assert bad["status"] == 422
    assert WorkflowExecution.objects.filter(tenant=tenant).count() == 1
    assert [path for path, _ in pooled] == [
        "/api/v1/workflows/pooled_start/executions",
        f"/api/v1/executions/{execution_id}",
        "/api/v1/workflows/nope/executions",
        "/api/v1/workflows/pooled_start/executions",
    ]
    assert all(thread.startswith("delivery-db-") for _, thread in pooled)
    assert hops == []


def test_a_pool_thread_drops_a_connection_a_database_error_broke():
    """The sync chain answers a database error with a 500, so the pool never sees it: the
    thread's kept connection is checked then, and dropped if it no longer answers."""

    def broken_then_dropped() -> tuple[bool, bool]:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        connection.connection.close()  # as if the database had restarted
        with pytest.raises(DatabaseError), connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        one_hop.drop_if_broken()
        dropped = connection.connection is None
        with connection.cursor() as cursor:  # the next call opens a fresh one
            cursor.execute("SELECT 1")
        one_hop.drop_if_broken()  # no error since: nothing to check, nothing dropped
        return dropped, connection.connection is not None

    try:
        assert run_async(delivery_db.call(broken_then_dropped)) == (True, True)
    finally:
        delivery_db.close()


def test_a_sync_requests_objects_go_with_its_response_not_at_a_collection(
    monkeypatch, write_key, tenant
):
    """The middleware's lazy user, ``auser`` and message storages refer back to the request;
    once the response is built those cycles are broken, so the request (and its session,
    headers, key and tenant) is freed by reference counting, on the pooled route and the
    one-hop route alike, and a stream of starts leaves the cyclic collector nothing to find
    (its collections paused the server during idle pickups)."""
    handler = asgi.django_asgi_app
    requests: list[weakref.ref] = []
    get_response = handler.sync_handler.get_response

    def recording(request):
        requests.append(weakref.ref(request))
        response = get_response(request)
        assert request.user.is_anonymous  # every middleware still ran and can read it
        return response

    monkeypatch.setattr(handler.sync_handler, "get_response", recording)
    tasks = [{"id": "a", "function": "steps:noop"}]
    files = {
        "cloacina.toml": manifest_toml(tasks, name="freed", workflow="freed"),
        "workflow/steps.py": "def noop(context):\n    return None\n",
    }
    assert upload(Client(), write_key, build_archive(files)).status_code == 201
    gc.collect()
    gc.disable()
    try:
        started = call("POST", "/api/v1/workflows/freed/executions", write_key, b"{}")
        listed = call("GET", "/api/v1/executions", write_key)  # the one-hop route
        alive = [ref for ref in requests if ref() is not None]
    finally:
        gc.enable()
        delivery_db.close()
    assert started["status"] == 201 and listed["status"] == 200
    assert route_of("/api/v1/executions") is Route.ONE_HOP
    assert len(requests) == 2 and alive == []
