"""Daphne's HTTP requests without Twisted's own parsing of form uploads.

Twisted's ``http.Request`` parses every ``multipart/form-data`` POST into
``request.args`` before daphne sees it: a second in-memory copy of each
package upload that daphne never reads, and for a body it cannot parse a
bare ``400`` with no body — answered before Django, so before authentication
and before the API's JSON errors.  Django parses request bodies itself, so
the Twisted pass is switched off for the requests daphne builds.
"""

from __future__ import annotations


def disable_twisted_form_parsing() -> None:
    """Make daphne's WebRequest skip Twisted's POST form parsing (idempotent)."""
    from daphne import http_protocol

    request_class = http_protocol.WebRequest
    if getattr(request_class, "_cloacina_formless", False):
        return
    original_init = request_class.__init__

    def __init__(self, *args, **kwargs):
        kwargs["parsePOSTFormSubmission"] = False
        original_init(self, *args, **kwargs)

    request_class.__init__ = __init__
    request_class._cloacina_formless = True
