"""What every API operation shares: one error shape, JSON-object bodies, documented roles.

Errors are ``{"detail": "<what is wrong>"}``.  The layers every operation goes
through — bearer authentication (401, 403), URL and body parsing (400) and
parameter validation (422) — are declared here once, in the OpenAPI document, so each
operation documents the statuses it can really answer with, including
operations added later.  Validation errors keep django-ninja's structured list
under ``errors``, but their ``detail`` is a string naming the fields, like
every other error of this API.

Every JSON body of this API is an object: django-ninja's schemas read
attributes (``from_attributes``), so without :class:`ObjectBodyParser` a body
of ``[]`` or ``5`` would pass as "every field at its default".

Each operation's ``x-roles`` lists the key roles it accepts (what
``KeyAuth`` enforces), so clients and tests read "who may call this" from the
document rather than from a table kept by hand.
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeVar

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.db.utils import InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse
from django.http.multipartparser import MultiPartParserError
from ninja import NinjaAPI
from ninja.errors import HttpError, ValidationError
from ninja.parser import Parser
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError

from fleet.api.error_status import http_status
from fleet.engine.context import unstorable
from fleet.platform.auth import ROLE_IMPLIES
from fleet.platform.errors import DomainError

DETAIL_MAX_CHARS = 1000  # a huge body with many errors must not echo back megabytes
ERRORS_MAX = 50

ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "detail": {"type": "string", "title": "Detail"},
        "errors": {"type": "array", "items": {"type": "object"}, "title": "Errors"},
    },
    "required": ["detail"],
}
SHARED = {
    400: "the request body could not be parsed, or the URL holds a NUL character",
    401: "missing, invalid or revoked API key",
    403: "the key's role may not call this operation",
    413: "the request body is over the server's limit",
    422: "a parameter or the body is invalid; detail names it",
    503: "the database is unavailable (restarting); retry",
}


def _field(loc: Any) -> str:
    parts: list[str] = []
    for part in loc if isinstance(loc, list | tuple) else [loc]:
        text = str(part)
        if not parts or parts[-1] != text:  # ninja repeats the source ("body", "body")
            parts.append(text)
    return ".".join(parts)


# pydantic speaks Python ("a valid dictionary"); a client sent JSON.
JSON_WORDING = {
    "dict_type": "must be a JSON object",
    "model_type": "must be a JSON object",
    "list_type": "must be a JSON array",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
}


def validation_detail(errors: list[dict]) -> str:
    """``"body.context: must be a JSON object; query.limit: …"``."""
    detail = "; ".join(
        f"{_field(e.get('loc', ()))}: {JSON_WORDING.get(e.get('type'), e.get('msg', 'invalid'))}"
        for e in errors
    )
    if len(detail) > DETAIL_MAX_CHARS:
        detail = detail[: DETAIL_MAX_CHARS - 1] + "…"
    return detail or "invalid request"


class BodyNotAnObject(ValueError):
    """A JSON body that parsed, but is not an object."""


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    return "a number"


def _refuse_constant(name: str) -> Any:
    raise BodyNotAnObject(
        f"the request body is not valid JSON: {name} is not a JSON number (JSON numbers are finite)"
    )


class ObjectBodyParser(Parser):
    """JSON bodies must be strict JSON objects: UTF-8 (no raw surrogate bytes), finite
    numbers (no NaN or Infinity, which jsonb refuses), and no NUL character or lone
    surrogate anywhere (PostgreSQL can neither store nor compare one): 400/422 otherwise,
    naming what was sent."""

    def parse_body(self, request: HttpRequest):
        # json.loads(bytes) decodes with "surrogatepass": raw bytes of a lone surrogate
        # (b"\xed\xa0\x80") would come through as text no database can store.
        try:
            text = request.body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"invalid UTF-8 at byte {exc.start} (raw surrogate or non-UTF-8 bytes)"
            ) from None
        data = json.loads(text, parse_constant=_refuse_constant)
        if not isinstance(data, dict):
            raise BodyNotAnObject(f"the request body must be a JSON object, not {_json_kind(data)}")
        problem = unstorable(data) if "\\u" in text else ""
        if problem:
            raise BodyNotAnObject(f"the request body holds {problem}")
        return data


FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
BodyModel = TypeVar("BodyModel", bound=BaseModel)


def optional_body(request: HttpRequest, schema: type[BodyModel]) -> BodyModel | None:
    """An optional JSON body (not a ninja body parameter): None without one, or with a form
    body (what a bare POST from many HTTP clients sends); any other body is parsed as
    strictly as every other (this API's parser, whatever the content type, as for ninja's
    own body parameters) and must be exactly ``schema`` (422 naming the field otherwise)."""
    if not request.body or request.content_type in FORM_TYPES:
        return None
    try:
        data = ObjectBodyParser().parse_body(request)
    except BodyNotAnObject as exc:
        raise HttpError(422, str(exc)) from None
    except ValueError as exc:  # JSON or UTF-8 decoding
        raise HttpError(400, f"the request body is not valid JSON: {exc}") from None
    try:
        return schema.model_validate(data)
    except PydanticValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise ValidationError(errors) from None


def optional_body_doc(schema: type[BaseModel]) -> dict:
    """What OpenAPI shows for a body :func:`optional_body` reads (``openapi_extra``)."""
    return {
        "requestBody": {
            "required": False,
            "content": {"application/json": {"schema": schema.model_json_schema()}},
        }
    }


def install_error_handlers(api: NinjaAPI) -> None:
    """Every error this API answers with is ``{"detail": str}`` (+ ``errors`` for 422)."""

    def on_validation_error(request: HttpRequest, exc: ValidationError) -> HttpResponse:
        body = {"detail": validation_detail(exc.errors), "errors": exc.errors[:ERRORS_MAX]}
        return api.create_response(request, body, status=422)

    def on_http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
        # django-ninja wraps any body-parsing failure in a bare 400 "Cannot parse request
        # body"; say what was wrong with it instead.
        cause, status, detail = exc.__cause__, exc.status_code, str(exc)
        if status == 400 and isinstance(cause, BodyNotAnObject):
            status, detail = 422, str(cause)
        elif status == 400 and isinstance(cause, ValueError):  # JSON or UTF-8 decoding
            detail = f"the request body is not valid JSON: {cause}"[:DETAIL_MAX_CHARS]
        return api.create_response(request, {"detail": detail}, status=status)

    def on_too_big(request: HttpRequest, exc: RequestDataTooBig) -> HttpResponse:
        # Django would answer a bare HTML 400 for a body over DATA_UPLOAD_MAX_MEMORY_SIZE.
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        size = request.META.get("CONTENT_LENGTH") or "more than that"
        detail = (
            f"the request body is {size} bytes; the limit is {limit} "
            "(a context may hold CLOACINA_MAX_CONTEXT_BYTES)"
        )
        return api.create_response(request, {"detail": detail}, status=413)

    def on_multipart_error(request: HttpRequest, exc: MultiPartParserError) -> HttpResponse:
        # Django would answer an HTML page; this API answers JSON.
        detail = f"the multipart/form-data body could not be parsed: {exc}"[:DETAIL_MAX_CHARS]
        return api.create_response(request, {"detail": detail}, status=400)

    def on_domain_error(request: HttpRequest, exc: DomainError) -> HttpResponse:
        # A service refused the request: its kind picks the status (error_status's table).
        response = api.create_response(request, {"detail": exc.detail}, status=http_status(exc))
        if exc.retry_after_s is not None:  # whole seconds, never 0: "now" would be a hot loop
            response["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
        return response

    api.add_exception_handler(ValidationError, on_validation_error)
    api.add_exception_handler(DomainError, on_domain_error)
    api.add_exception_handler(HttpError, on_http_error)
    api.add_exception_handler(MultiPartParserError, on_multipart_error)
    api.add_exception_handler(RequestDataTooBig, on_too_big)

    def on_database_away(request: HttpRequest, exc: Exception) -> HttpResponse:
        # The database restarting is not the client's fault, nor a bug: say so, and when.
        response = api.create_response(
            request, {"detail": "the database is unavailable; retry shortly"}, status=503
        )
        response["Retry-After"] = "1"
        return response

    api.add_exception_handler(OperationalError, on_database_away)
    api.add_exception_handler(InterfaceError, on_database_away)


def accepted_roles(auth_callbacks) -> list[str] | None:
    """The key roles an operation's authentication lets through; None when unknown."""
    required: set[str] = set()
    for auth in auth_callbacks:
        roles = getattr(auth, "roles", None)
        if roles is None:
            return None
        required |= set(roles)
    return sorted(str(role) for role, grants in ROLE_IMPLIES.items() if grants & required)


def operation_roles(api: NinjaAPI) -> dict[str, list[str]]:
    """operationId → accepted key roles, for every operation whose auth names its roles."""
    result: dict[str, list[str]] = {}
    # ninja keeps no public list of operations; the bound routers are what its own
    # OpenAPI generator walks (ninja is pinned in requirements.txt).
    for router in api._get_bound_routers():
        for path_view in router.path_operations.values():
            for operation in path_view.operations:
                roles = accepted_roles(operation.auth_callbacks)
                if roles is not None:
                    result[api.get_openapi_operation_id(operation)] = roles
    return result


def document_shared_contract(schema: dict, roles: dict[str, list[str]]) -> dict:
    """Add the shared error responses and ``x-roles`` to every operation."""
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            if operation.get("operationId") in roles:
                operation["x-roles"] = roles[operation["operationId"]]
            codes = []
            if operation.get("security"):
                codes += [401, 403]
            if operation.get("requestBody") or operation.get("parameters"):
                codes.append(422)
            codes += [400, 503]  # RejectNulInUrl answers 400 for any URL; a DB restart 503
            if operation.get("requestBody"):
                codes.append(413)
            responses = operation["responses"]
            for code in codes:
                responses.setdefault(
                    code,
                    {
                        "description": SHARED[code],
                        "content": {"application/json": {"schema": ERROR_SCHEMA}},
                    },
                )
    return schema
