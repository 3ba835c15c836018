"""What the browser-facing pages are allowed to do, and who may ask for them.

* **Content-Security-Policy** on every HTML response (console, admin, API docs):
  scripts, styles, fonts and connections from this server only, no inline script
  or style, no plugins, no framing.  The console (htmx and console.js, both static
  files) and Swagger UI (django-ninja's bundled copy, served from /static/ninja/)
  need nothing more; a markup injection can then load nothing and run nothing.
* **ALLOWED_HOSTS** from ``CLOACINA_ALLOWED_HOSTS``; the loopback names are always
  added, so the agents the process actuator starts (they dial 127.0.0.1) and a
  local operator keep working.  They are no DNS-rebinding risk: a rebinding page
  sends its own host name, which is not on the list.
* **Over TLS**: session and CSRF cookies marked Secure, and HSTS.
* **Login lockout** (django-axes, configured in settings): the client address is
  the connection's, never a forwarded-for header a client could write itself.
"""

from __future__ import annotations

from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.core.exceptions import DisallowedHost
from django.http import HttpRequest, HttpResponse, JsonResponse

from fleet.platform.config import Config

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",  # the console's empty favicon and Swagger UI's icons
        "font-src 'self'",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)
LOOPBACK_HOSTS = ["localhost", "127.0.0.1", "[::1]"]


def allowed_hosts(config: Config) -> list[str]:
    hosts = config.allowed_host_list
    if "*" in hosts:
        return ["*"]
    return hosts + [host for host in LOOPBACK_HOSTS if host not in hosts]


def tls_settings(tls_on: bool, hsts_seconds: int) -> dict[str, Any]:
    """The Django settings that depend on whether the server speaks TLS."""
    return {
        "SESSION_COOKIE_SECURE": tls_on,
        "CSRF_COOKIE_SECURE": tls_on,
        # SecurityMiddleware sends HSTS on secure requests only, so plain HTTP never gets it.
        "SECURE_HSTS_SECONDS": hsts_seconds if tls_on else 0,
    }


def apply_tls_settings(tls_on: bool, hsts_seconds: int) -> None:
    """For `serve`: its --tls-cert flag is known only after settings were loaded.

    Call before the ASGI application is built (SecurityMiddleware reads HSTS once).
    """
    from django.conf import settings

    for name, value in tls_settings(tls_on, hsts_seconds).items():
        setattr(settings, name, value)


def connection_address(request: HttpRequest) -> str | None:
    """The address login attempts are counted under: the TCP peer's, never a header's."""
    return request.META.get("REMOTE_ADDR")


def bad_request(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    """handler400: JSON like the API's errors, not Django's HTML page (a wrong Host, …)."""
    if isinstance(exception, DisallowedHost):
        host = request.META.get("HTTP_HOST", "")[:100]
        detail = f"this server does not answer to host {host!r} (see CLOACINA_ALLOWED_HOSTS)"
    else:
        detail = "bad request"
    return JsonResponse({"detail": detail}, status=400)


def _with_policy(response: HttpResponse) -> HttpResponse:
    if response.get("Content-Type", "").startswith("text/html"):
        response.headers.setdefault("Content-Security-Policy", CONTENT_SECURITY_POLICY)
    return response


class ContentSecurityPolicy:
    """Adds :data:`CONTENT_SECURITY_POLICY` to HTML responses (async-capable, like
    request_guards, so requests do not hop to a thread and back for it)."""

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
        return _with_policy(self.get_response(request))

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        return _with_policy(await self.get_response(request))
