"""Requests PostgreSQL could not even be asked about: refused before any view runs.

A NUL character (``%00``) cannot be stored in or compared with a PostgreSQL
text value — psycopg refuses the query — so a URL path or query string
holding one would turn every lookup it reaches into a 500.  No name, id or
filter of this server contains one, so such a request is refused with 400.

The middleware is async-capable like Django's own: a sync-only middleware in
the chain makes every request hop from the event loop to a thread and back
(twice), which cost about as much CPU as the request's own work.
"""

from __future__ import annotations

import json

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponse


def _refusal(request: HttpRequest) -> HttpResponse | None:
    if "\x00" in request.path or "%00" in request.META.get("QUERY_STRING", ""):
        return HttpResponse(
            json.dumps({"detail": "the URL holds a NUL character (%00)"}),
            status=400,
            content_type="application/json",
        )
    return None


class RejectNulInUrl:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response) -> None:
        self.get_response = get_response
        self._async = iscoroutinefunction(get_response)
        if self._async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest):
        if self._async:
            return self.__acall__(request)
        return _refusal(request) or self.get_response(request)

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        return _refusal(request) or await self.get_response(request)
