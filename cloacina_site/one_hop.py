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
"""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.base import BaseHandler
from django.http import HttpRequest, HttpResponse
from django.urls import Resolver404, resolve


class OneHopASGIHandler(ASGIHandler):
    def __init__(self) -> None:
        super().__init__()  # the async chain, for async views
        # Its own instance: the sync chain's view, template and exception middleware lists
        # hold the plain methods, the async chain's their awaitable adaptations.
        self.sync_handler = BaseHandler()
        self.sync_handler.load_middleware(is_async=False)
        self.one_hop = sync_to_async(self.sync_handler.get_response, thread_sensitive=True)

    async def get_response_async(self, request: HttpRequest) -> HttpResponse:
        if is_async_view(request.path_info):
            return await super().get_response_async(request)
        return await self.one_hop(request)


def is_async_view(path: str) -> bool:
    """Whether ``path`` resolves to an async view (an unknown path is a sync 404)."""
    try:
        return iscoroutinefunction(resolve(path).func)
    except Resolver404:
        return False
