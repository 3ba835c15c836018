"""The one table from a domain refusal's kind to its HTTP status.

The API (``fleet.api.contract``'s handler for :class:`~fleet.platform.errors.DomainError`),
the console and the build-job views all answer through it, so a kind means the same
status everywhere and the services below never name an HTTP code.
"""

from __future__ import annotations

from fleet.platform.errors import DomainError, ErrorKind

HTTP_STATUS: dict[ErrorKind, int] = {
    ErrorKind.MALFORMED: 400,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.CONFLICT: 409,
    ErrorKind.TOO_LARGE: 413,
    ErrorKind.INVALID: 422,
    ErrorKind.LIMITED: 429,
    ErrorKind.INTERNAL: 500,
    ErrorKind.UPSTREAM_FAILED: 502,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.UPSTREAM_TIMEOUT: 504,
}


def http_status(error: DomainError | ErrorKind | str) -> int:
    """The status for a refusal, its kind, or a kind's stored name (a build job's row)."""
    kind = error.kind if isinstance(error, DomainError) else ErrorKind(error)
    return HTTP_STATUS[kind]
