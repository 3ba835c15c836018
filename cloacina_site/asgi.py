"""ASGI entry point: Django for HTTP, Channels for the agents' delivery WebSocket.

HTTP goes through :class:`BodyLimit` first, so a body past the largest legitimate
one is a 413 before Django (and authentication) runs.  Under `serve`, daphne
already refuses such a body while it streams in (cloacina_site/daphne_limits.py);
this layer keeps the cap for any other ASGI server the application is run under.
"""

import json
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cloacina_site.settings")
get_asgi_application()  # django.setup(), before anything imports a model

from cloacina_site.one_hop import OneHopASGIHandler  # noqa: E402

# Django's handler, its middleware in one hop to the sync thread (cloacina_site/one_hop.py).
django_asgi_app = OneHopASGIHandler()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from agents.surface.routing import websocket_urlpatterns  # noqa: E402
from cloacina_site.daphne_limits import body_too_large_detail  # noqa: E402
from fleet.platform.config import get_config  # noqa: E402


class BodyLimit:
    """Refuses (413, JSON) an HTTP body declared or received past ``limit`` bytes."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _declared_length(scope) > self.limit:
            await self._refuse(send)
            return
        received = 0
        over = False
        started = False

        async def counting_receive():
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    # Django stops reading at a disconnect and answers nothing: we answer.
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def watching_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counting_receive, watching_send)
        if over and not started:
            await self._refuse(send)

    async def _refuse(self, send) -> None:
        body = json.dumps({"detail": body_too_large_detail(self.limit)}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _declared_length(scope) -> int:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0  # not a number: the server in front refuses it, not us
    return 0


application = ProtocolTypeRouter(
    {
        "http": BodyLimit(django_asgi_app, get_config().max_request_bytes),
        "websocket": URLRouter(websocket_urlpatterns),
    }
)
