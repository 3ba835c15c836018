"""Registering on the delivery socket (docs/agent-protocol.md, "Registering on the socket").

The agent opens ``/ws/agents/`` with its key and sends its registration body as a
``register`` frame; the server answers ``registered`` (the REST answer) and the same
socket then carries the session (hello first), or answers ``refused`` and closes.  One
connection and one handshake instead of a REST request and then a socket.

A refusal raises the REST client's error for the same refusal, so the agent acts on it
exactly as on a REST answer (stop, wait, try the other wire format).  A socket that cannot
be opened, or that an older server has no route for, raises :class:`NotOnSocket`: the agent
registers over REST instead, which also says why a server is unreachable (TLS included).
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from agents.protocol import wire
from agents.runtime.client import (
    AuthRejected,
    ClientError,
    ProtocolMismatch,
    RateLimited,
    Registration,
    RequestRejected,
    ServerUnavailable,
    websocket_url,
)
from agents.runtime.connection import (
    UNAVAILABLE_HANDSHAKE,
    open_socket,
    retry_after_in_reason,
)

REGISTER_PATH = "/ws/agents/"
ANSWER_TIMEOUT_S = 30.0  # as a REST request's (client.REQUEST_TIMEOUT_S)
# Close codes without a ``refused`` frame before them, as REST statuses.
_CLOSE_STATUS = {4401: 401, 4403: 403, 4013: 429, 1013: 429, 4400: 422, 4413: 413}


class NotOnSocket(Exception):
    """Register over REST instead; ``older_server``: the server has no such socket (an
    HTTP refusal of the handshake), so do not try it on that server again."""

    def __init__(self, message: str, older_server: bool = False) -> None:
        super().__init__(message)
        self.older_server = older_server


def refusal_error(status: int, detail: str, retry_after_s: float | None = None) -> ClientError:
    """The REST client's error for a registration refused with ``status``."""
    if status in (401, 403):
        return AuthRejected(f"the server rejected the API key ({status}): {detail}", status)
    if status == 409:
        return ProtocolMismatch(detail, 409)
    if status == 429:
        return RateLimited(f"registration refused for now (429): {detail}", retry_after_s)
    if 400 <= status < 500 and status != 404:
        return RequestRejected(f"registration rejected ({status}): {detail}", status)
    return ServerUnavailable(f"registration on the socket failed ({status}): {detail}", status)


async def register_on_socket(
    server_url: str, api_key: str, body: dict[str, Any], ssl_context: ssl.SSLContext | None
) -> tuple[ClientConnection, Registration]:
    """Register with ``body``; the open socket (hello not sent yet) and the registration."""
    try:
        ws = await open_socket(websocket_url(server_url, REGISTER_PATH), api_key, ssl_context)
    except InvalidStatus as exc:
        status = exc.response.status_code
        older = status != 429 and status not in UNAVAILABLE_HANDSHAKE
        raise NotOnSocket(f"handshake refused with HTTP {status}", older_server=older) from None
    except (OSError, TimeoutError, InvalidHandshake, InvalidURI, EOFError) as exc:
        raise NotOnSocket(f"cannot connect: {type(exc).__name__}: {exc}") from None
    try:
        await ws.send(wire.encode({"type": "register", **body}, "json"))
        answer = await asyncio.wait_for(ws.recv(), ANSWER_TIMEOUT_S)
        frame = wire.decode(answer, "json")
    except ConnectionClosed:
        raise _closed_without_answer(ws) from None
    except (TimeoutError, OSError, wire.WireFormatError) as exc:
        await ws.close()
        raise ServerUnavailable(
            f"registration on the socket: {type(exc).__name__}: {exc}"
        ) from None
    if frame.get("type") == "registered":
        return ws, Registration.from_answer(frame, body)
    await ws.close()
    if frame.get("type") == "refused" and isinstance(frame.get("status"), int):
        retry = frame.get("retry_after_s")
        raise refusal_error(
            frame["status"],
            str(frame.get("detail", "")),
            float(retry) if isinstance(retry, int | float) else None,
        )
    raise ServerUnavailable(f"registration on the socket answered {frame.get('type')!r}")


def _closed_without_answer(ws: ClientConnection) -> ClientError:
    """The error for a registering socket the server closed before answering."""
    code, reason = ws.close_code or 1006, ws.close_reason or ""
    if code in (4012, 1012):  # the server is stopping: another one (ServerUnavailable)
        return ServerUnavailable(f"the server is stopping ({code}: {reason})", 503)
    status = _CLOSE_STATUS.get(code)
    if status is None:
        return ServerUnavailable(f"registering socket closed ({code}: {reason})")
    return refusal_error(status, reason or f"close code {code}", retry_after_in_reason(reason))
