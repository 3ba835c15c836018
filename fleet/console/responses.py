"""How console views answer: login, allowed methods, and the shape of action results.

Actions are posted either by htmx (a button in a live page) or by a plain form
(no JavaScript).  htmx gets 204 + an ``HX-Trigger`` event that makes the live
partials refresh at once and shows a flash line; errors come back as JSON
``{"detail": ...}`` with a 4xx status, which console.js shows in the flash bar.
A plain form gets a redirect back (success) or an error page with the status.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from urllib.parse import quote

from django.conf import settings
from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render

from fleet.api.error_status import http_status
from fleet.platform.errors import DomainError

View = Callable[..., HttpResponse]

# The event every live fleet partial also listens to, so an action shows at once.
FLEET_CHANGED_EVENT = "fleet-changed"


class ConsoleError(Exception):
    """An action the console refuses; ``status`` is the HTTP code, the message names the problem."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def is_htmx(request: HttpRequest) -> bool:
    return request.headers.get("HX-Request") == "true"


def console_view(methods: Iterable[str] = ("GET",)) -> Callable[[View], View]:
    """Login required, only ``methods`` allowed (405 otherwise), errors answered uniformly."""
    allowed = tuple(m.upper() for m in methods)

    def decorate(view: View) -> View:
        @functools.wraps(view)
        def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            if request.method not in allowed:
                response = HttpResponse(
                    f"method {request.method} not allowed here",
                    status=405,
                    content_type="text/plain",
                )
                response["Allow"] = ", ".join(allowed)
                return response
            if not request.user.is_authenticated:
                return _to_login(request)
            try:
                return view(request, *args, **kwargs)
            except PermissionDenied as exc:
                return action_failed(request, 403, str(exc) or "forbidden")
            except Http404 as exc:
                return action_failed(request, 404, str(exc) or "not found")
            except ConsoleError as exc:
                return action_failed(request, exc.status, str(exc))

        return wrapper

    return decorate


def _to_login(request: HttpRequest) -> HttpResponse:
    if is_htmx(request):
        # A polled partial must not swap the login form into a table cell:
        # send the whole page to the login screen, then back to where it was.
        page = request.headers.get("HX-Current-URL") or settings.LOGIN_REDIRECT_URL
        response = HttpResponse(status=401)
        response["HX-Redirect"] = f"{settings.LOGIN_URL}?next={quote(page)}"
        return response
    return redirect(f"{settings.LOGIN_URL}?next={quote(request.get_full_path())}")


def action_done(request: HttpRequest, message: str, back_to: str) -> HttpResponse:
    """A successful action: 204 + refresh event for htmx, redirect with a message otherwise."""
    if is_htmx(request):
        response = HttpResponse(status=204)
        response["HX-Trigger"] = json.dumps(
            {FLEET_CHANGED_EVENT: True, "console-flash": {"level": "ok", "message": message}}
        )
        return response
    messages.success(request, message)
    return redirect(back_to)


def action_failed(request: HttpRequest, status: int, detail: str) -> HttpResponse:
    """A refused request: JSON detail for htmx, an error page for a plain browser request."""
    if is_htmx(request):
        return JsonResponse({"detail": detail}, status=status)
    return render(
        request, "console/error.html", {"status": status, "detail": detail}, status=status
    )


def action_done_go_to(request: HttpRequest, message: str, page: str) -> HttpResponse:
    """A successful action whose result is another page (a new execution, a re-opened one):
    the message is kept for that page, htmx is told to load it (``HX-Redirect``), a plain
    form is redirected to it."""
    messages.success(request, message)
    if is_htmx(request):
        response = HttpResponse(status=204)
        response["HX-Redirect"] = page
        return response
    return redirect(page)


@contextmanager
def refusals_answered() -> Iterator[None]:
    """A service's refusal (a DomainError) becomes the console's answer with the status its
    kind means everywhere (fleet.api.error_status) and the service's own words."""
    try:
        yield
    except DomainError as exc:
        raise ConsoleError(exc.detail, http_status(exc)) from None
