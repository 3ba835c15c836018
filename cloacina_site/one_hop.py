"""Django's ASGI handler with the middleware run in one hop to the sync thread.

Under ASGI, Django runs the middleware chain in async mode, and each of its own
middleware (``MiddlewareMixin``: security, sessions, common, CSRF, auth, messages,
clickjacking) hops from the event loop to the sync thread and back for its
``process_request`` and again for its ``process_response``: about fourteen hops for a
request whose view is sync anyway.  Measured on ``GET /executions/{id}`` under `serve`,
those hops were a third of the server's CPU for the request (docs/performance.md).

:class:`OneHopASGIHandler` builds a second, sync chain of the same middleware in the same
order (as under WSGI) and calls it with one hop.  A request for an async view (the agents'
result endpoint) still takes Django's async chain, so it never holds the sync thread while
it awaits.

The agents' registration and deregistration (see
``agents.surface.api.POOLED_VIEWS``) take the same sync chain in one hop to a thread of the
delivery database pool instead.  A registration storm is thousands of them at once: on
the per-request sync thread each one also borrowed a connection from the pool (and checked
it with a round trip), while the delivery threads keep theirs and prepare the few
statements these endpoints run (docs/scaling.md, "Registration storms").  At most
:data:`POOLED_AT_ONCE` of them hold a pool thread at a time: registrations of one tenant
take turns on its roster lock, and a storm's registrations waiting there must not hold
every thread while the sockets' hellos and the results wait behind them (agents that
connected in a storm were evicted for beats that waited on their hello).

A user's start of an execution and the poll of it (``fleet.api.executions.POOLED_VIEWS``)
take that route too: a burst of starts is thousands of short requests, and on the
per-request sync thread each one paid for a new thread, the signal hops and a checked
borrow from the pool (docs/performance.md, "Round i17-burst").

Those pooled requests also skip the per-request machinery of Django's ASGI entry point
(:meth:`OneHopASGIHandler.handle_pooled`): a ``ThreadSensitiveContext`` whose first
hop starts a new thread (joined again when the request ends), and the hops that send
``request_started`` and close the response on it.  For a registration that was about an
eighth of the server's CPU, and a connect storm is nothing but registrations
(docs/scaling.md, "What a registration costs").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from enum import Enum

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.conf import settings
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.core.handlers.base import BaseHandler
from django.db import connection, connections
from django.http import HttpRequest, HttpResponse
from django.urls import Resolver404, resolve, set_script_prefix

from agents.surface.api import POOLED_VIEWS as AGENT_POOLED_VIEWS
from fleet.api.executions import POOLED_VIEWS as EXECUTION_POOLED_VIEWS
from fleet.executors.fleet.delivery import db as delivery_db

POOLED_AT_ONCE = 4  # of the delivery pool's threads (fleet/executors/fleet/delivery/db.py)
POOLED_VIEWS = AGENT_POOLED_VIEWS | EXECUTION_POOLED_VIEWS


class Route(Enum):
    ASYNC = "async"  # Django's async chain
    ONE_HOP = "one_hop"  # the sync chain, in one hop to the request's sync thread
    POOLED = "pooled"  # the sync chain, in one hop to a delivery pool thread


class OneHopASGIHandler(ASGIHandler):
    def __init__(self) -> None:
        super().__init__()  # the async chain, for async views
        # Its own instance: the sync chain's view, template and exception middleware lists
        # hold the plain methods, the async chain's their awaitable adaptations.
        self.sync_handler = BaseHandler()
        self.sync_handler.load_middleware(is_async=False)
        self.one_hop = sync_to_async(self.respond_and_release, thread_sensitive=True)
        self.pooled_slots = asyncio.Semaphore(POOLED_AT_ONCE)
        self.release_connections = sync_to_async(release_connections, thread_sensitive=True)

    def respond_and_release(self, request: HttpRequest) -> HttpResponse:
        """The sync chain's response, this request thread's database connections given back
        before the thread lets go of it (a streaming response keeps them until it is closed).

        Django gives them back on request_finished, which never comes for a request the
        server killed after its client went away (daphne cancels the application; the view
        runs on in its thread and the response is dropped): each such request kept a
        pooled connection for good, and a connect storm of impatient clients drained the
        whole pool (PoolTimeout in every job)."""
        try:
            response = self.sync_handler.get_response(request)
        except BaseException:
            release_connections()
            raise
        if not response.streaming:
            release_connections()
            free_request(request)
        return response

    async def pooled(self, request: HttpRequest) -> HttpResponse:
        """The sync chain on a delivery pool thread (its connection kept, not borrowed), at
        most POOLED_AT_ONCE requests at a time; the others wait on the event loop."""
        async with self.pooled_slots:
            return await delivery_db.call(self.respond_on_pool_thread, request)

    def respond_on_pool_thread(self, request: HttpRequest) -> HttpResponse:
        """The sync chain's response.  The chain turns a database error into a 500, so the
        pool never sees it: a connection the error left broken (the database restarted) is
        dropped here, or the thread would keep answering with it."""
        try:
            response = self.sync_handler.get_response(request)
        finally:
            drop_if_broken()
        free_request(request)
        return response

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "http" and route_of(path_info(scope)) is Route.POOLED:
            await self.handle_pooled(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    async def handle_pooled(self, scope: dict, receive, send) -> None:
        """Django's ``handle`` for a pooled request, with no hop but the one to the pool.

        Django wraps every request in a ``ThreadSensitiveContext`` (a new executor thread
        for its first hop) and sends ``request_started`` and closes the response with a
        hop each to that thread.  Those signals' receivers would, on the pool thread,
        close the connection it keeps (``close_old_connections``: ``CONN_MAX_AGE`` is
        0); elsewhere they find nothing to do for these views (no connection of the
        request's own thread, no cache, no per-request urlconf), and the responses hold
        no resources to close.  As in Django, a client that goes away while its request
        waits for a pool slot frees the turn: the request is cancelled, never run."""
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        try:
            set_script_prefix(get_script_prefix(scope))
            request, error_response = self.create_request(scope, body_file)
            if request is None:
                await self.send_response(error_response, send)
                return
            response = await self.pooled_unless_gone(request, receive)
            if response is not None:
                await self.send_response(response, send)
        finally:
            body_file.close()

    async def pooled_unless_gone(self, request: HttpRequest, receive) -> HttpResponse | None:
        """The pooled response, or None when the client disconnected first.

        The response is awaited in this task; a watcher task cancels it if the client goes
        away.  (It was two tasks raced with ``asyncio.wait`` and then gathered: ~20 µs more
        of the event loop's CPU per pooled request, docs/performance.md, "Round i17-start".)
        Cancelled while it waits for a pool slot, the request never runs; once on a pool
        thread it runs to its end and its response is dropped.  A cancellation from outside
        (daphne killing the application) still propagates."""
        this = asyncio.current_task()
        watcher = asyncio.ensure_future(self.cancel_when_gone(receive, this))
        try:
            return await self.pooled(request)
        except asyncio.CancelledError:
            # The watcher's cancellation is answered here; one from outside as well propagates.
            if watcher.done() and not watcher.cancelled() and this.uncancel() == 0:
                return None
            raise
        finally:
            watcher.cancel()  # no-op once it is done

    async def cancel_when_gone(self, receive, task: asyncio.Task) -> None:
        """Cancel ``task`` when the client disconnects (or sends what it may not: Django's
        ``listen_for_disconnect`` raises for both)."""
        with contextlib.suppress(Exception):
            await self.listen_for_disconnect(receive)
        task.cancel()

    async def get_response_async(self, request: HttpRequest) -> HttpResponse:
        route = route_of(request.path_info)
        if route is Route.POOLED:
            return await self.pooled(request)
        try:
            if route is Route.ASYNC:
                return await super().get_response_async(request)
            return await self.one_hop(request)
        except asyncio.CancelledError:
            # Killed while an async view's sync parts (sync_to_async on this request's
            # thread) may hold a connection: given back on that thread, after whatever is
            # still running there (see respond_and_release for the sync views).
            await asyncio.shield(self.release_connections())
            raise


# What the middleware hangs on a request that refers back to it: the lazy user (a closure
# over the request), ``auser`` (a partial of it) and the message storages (each keeps the
# request).  See free_request.
_CYCLIC_ATTRIBUTES = ("user", "auser", "_cached_user", "_messages")


def free_request(request: HttpRequest) -> None:
    """Break the reference cycles the middleware made through ``request`` once its
    (non-streaming) response is built: every middleware has run, and nothing reads them
    after.  A request in a cycle outlives its response until the cyclic collector finds it
    (some fifty objects a request: its session, message storages, headers, resolver match,
    API key and tenant), so a stream of REST starts kept the server's young generations
    full of garbage, and each generation-1 collection that freed it paused the whole
    process for 1–2.5 ms, an idle pickup's tail (docs/performance.md, "Round i17-idle").
    Freed by reference counting, the request goes when its response does."""
    attributes = request.__dict__
    for name in _CYCLIC_ATTRIBUTES:
        attributes.pop(name, None)


def drop_if_broken() -> None:
    """Close this thread's connection if a database error occurred on it and it no longer
    answers (one round trip, only after an error); the next call opens a new one."""
    if connection.errors_occurred:
        if connection.is_usable():
            connection.errors_occurred = False
        else:
            connection.close()


def release_connections() -> None:
    """Give this thread's database connections back (to the pool, when pooled)."""
    for conn in connections.all(initialized_only=True):
        conn.close()


def path_info(scope: dict) -> str:
    """The request's ``path_info`` as Django's ASGIRequest computes it from ``scope``."""
    script_name = get_script_prefix(scope)
    return scope["path"].removeprefix(script_name) if script_name else scope["path"]


def route_of(path: str) -> Route:
    """How the handler runs the view of ``path`` (an unknown path is a sync 404)."""
    return _route(settings.ROOT_URLCONF, path)


# Remembered per URL conf and path: resolving on the event loop, before the handler resolves
# the path again on its thread, was a fortieth of the server's CPU in a burst of starts
# (docs/performance.md, "Round i17-burst3"); a start's path repeats (it names the
# workflow), a GET's names its execution and only passes through.
@functools.lru_cache(maxsize=1024)
def _route(urlconf: str, path: str) -> Route:
    try:
        match = resolve(path, urlconf)
    except Resolver404:
        return Route.ONE_HOP
    if iscoroutinefunction(match.func):
        return Route.ASYNC
    return Route.POOLED if match.view_name in POOLED_VIEWS else Route.ONE_HOP


def is_async_view(path: str) -> bool:
    """Whether ``path`` resolves to an async view."""
    return route_of(path) is Route.ASYNC
