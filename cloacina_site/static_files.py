"""Static files straight from the finders (project static/ and each app's static/).

`serve` runs daphne alone, with no web server in front and no collectstatic
step, so the console's htmx.min.js and the admin's CSS are served from where
they live.  The files are few and small; caching headers come from Django's
static view (Last-Modified / If-Modified-Since).
"""

from __future__ import annotations

import os

from django.contrib.staticfiles import finders
from django.http import Http404, HttpRequest, HttpResponse
from django.views.static import serve


def static_file(request: HttpRequest, path: str) -> HttpResponse:
    if path.startswith("/") or ".." in path.split("/") or "\\" in path:
        raise Http404("no such static file")  # traversal attempts never reach the finders
    absolute = finders.find(path)
    if not absolute or isinstance(absolute, list) or not os.path.isfile(absolute):
        raise Http404(f"no static file {path!r}")
    directory, name = os.path.split(absolute)
    return serve(request, name, document_root=directory)
