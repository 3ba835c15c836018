"""What a refused request means, in the domain's words: no HTTP here.

Services (the scheduler, the control plane's limits, the roster, drain, package
uploads and builds) raise a :class:`DomainError` whose :class:`ErrorKind` says what
kind of refusal it is; the surface layer (the API's exception handler, the console)
turns the kind into a status code through its one table,
:data:`fleet.api.error_status.HTTP_STATUS`.  This module imports nothing of the
project, so every layer may raise these.
"""

from __future__ import annotations

import enum


class ErrorKind(enum.StrEnum):
    """Why a request is refused.  Stored by name on failed build jobs, so values are stable."""

    MALFORMED = "malformed"  # the input cannot be read at all (a broken archive)
    INVALID = "invalid"  # readable, but a value breaks a rule; the detail names it
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"  # the current state forbids it (already exists, dead, at the limit)
    TOO_LARGE = "too_large"
    LIMITED = "limited"  # a rate or count cap refuses it for now; retry later
    UPSTREAM_FAILED = "upstream_failed"  # a tool the server ran (pip) answered badly
    UPSTREAM_TIMEOUT = "upstream_timeout"  # a tool the server ran did not finish in time
    UNAVAILABLE = "unavailable"  # this server lacks what the request needs (pip missing)
    INTERNAL = "internal"  # the server failed unexpectedly (a bug, a crash)


class DomainError(Exception):
    """A refused request: ``kind`` classifies it, ``detail`` says why in the client's words."""

    def __init__(self, kind: ErrorKind, detail: str, retry_after_s: float | None = None) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail
        # A LIMITED refusal may know when to come back (the API sends it as Retry-After).
        self.retry_after_s = retry_after_s
