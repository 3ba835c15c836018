"""Requests PostgreSQL could not even be asked about: refused before any view runs.

A NUL character (``%00``) cannot be stored in or compared with a PostgreSQL
text value — psycopg refuses the query — so a URL path or query string
holding one would turn every lookup it reaches into a 500.  No name, id or
filter of this server contains one, so such a request is refused with 400.
"""

from __future__ import annotations

import json

from django.http import HttpRequest, HttpResponse


class RejectNulInUrl:
    def __init__(self, get_response) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if "\x00" in request.path or "%00" in request.META.get("QUERY_STRING", ""):
            return HttpResponse(
                json.dumps({"detail": "the URL holds a NUL character (%00)"}),
                status=400,
                content_type="application/json",
            )
        return self.get_response(request)
