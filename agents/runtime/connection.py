"""One session on the delivery WebSocket, and what its end means for the agent.

:func:`run_session` connects, hands every decoded frame to a callback and
returns a :class:`SessionEnd` saying why the session stopped; the agent's
connection loop decides from ``SessionEnd.action`` whether to reconnect (with
backoff), move to another server at once (the server is shutting down), wait as
long as a busy server asks, re-register first, or stop because the key was refused.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import re
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.frames import Frame, Opcode
from websockets.protocol import Event, State
from websockets.proxy import get_proxy
from websockets.uri import WebSocketURI, parse_uri

from agents.protocol import batching, frames, wire

log = logging.getLogger(__name__)

OPEN_TIMEOUT_S = 10.0
# Work packets carry the whole input context; accept more than the 1 MiB the server
# holds *us* to, so a large context reaches the task instead of killing the socket.
MAX_INCOMING_FRAME_BYTES = 64 * 1024 * 1024

# Keepalive pings on the delivery socket.  The agent's beats prove it alive to the server;
# the pings prove the server alive to the agent (a half-open socket, a server that stopped
# reading).  Sent once per liveness window (interval × misses) rather than websockets'
# default 20 s: with thousands of agents on one server, pings every 20 s were nearly half
# the frames an idle server received (docs/scaling.md).  A server that stops answering is
# noticed within the window + PING_TIMEOUT_S, as the server notices a silent agent within
# the window.  Never more often than websockets' default.
PING_TIMEOUT_S = 20.0
MIN_PING_INTERVAL_S = 20.0


def ping_interval_s(heartbeat_interval_s: float, liveness_misses: int) -> float:
    """Seconds between the agent's keepalive pings: one liveness window, at least 20 s."""
    return max(MIN_PING_INTERVAL_S, heartbeat_interval_s * liveness_misses)


CLOSE_BAD_KEY = 4401
CLOSE_KEY_NOT_ALLOWED = 4403
CLOSE_UNKNOWN_AGENT = 4404
CLOSE_SUPERSEDED = 4408
# The server is shutting down (SIGTERM): reconnect at once, to another server if there is one.
# 4000 + RFC 6455's 1012 "Service Restart" (the server's WebSocket library lets an
# application send only 1000 and 3000-4999); a proxy's own 1012 means the same.
CLOSE_GO_ELSEWHERE = 4012
# The server admits no more sockets this second: come back after the reason's "retry after
# N s".  4000 + RFC 6455's 1013 "Try Again Later" (a proxy's 1013 means the same).
CLOSE_TRY_LATER = 4013
_RETRY_AFTER_REASON = re.compile(r"retry after (\d+(?:\.\d+)?) ?s")
# Refused handshakes that mean "this server, not the agent": another one may take us.
UNAVAILABLE_HANDSHAKE = (502, 503, 504)


class Action(enum.Enum):
    RECONNECT = "reconnect"  # transient: try again (the next server) after a backoff delay
    MOVE = "move"  # the server is going away: reconnect to the next server at once
    WAIT = "wait"  # the server is busy: come back after SessionEnd.retry_after_s
    REREGISTER = "reregister"  # the server no longer knows this agent id
    DIAGNOSE = "diagnose"  # the handshake was refused over HTTP: ask the REST API why
    AUTH_FAILED = "auth_failed"  # the key is bad or not allowed: stop
    CLOSED_BY_US = "closed_by_us"


@dataclass(frozen=True)
class SessionEnd:
    action: Action
    detail: str
    opened: bool  # whether the socket was ever open (a handshake failure is not)
    retry_after_s: float | None = None  # with Action.WAIT: how long the server asked for


def action_for_close(code: int | None) -> Action:
    if code in (CLOSE_BAD_KEY, CLOSE_KEY_NOT_ALLOWED):
        return Action.AUTH_FAILED
    if code == CLOSE_UNKNOWN_AGENT:
        return Action.REREGISTER
    if code in (CLOSE_GO_ELSEWHERE, CLOSE_GO_ELSEWHERE - 3000):
        return Action.MOVE
    if code in (CLOSE_TRY_LATER, CLOSE_TRY_LATER - 3000):
        return Action.WAIT
    return Action.RECONNECT


def retry_after_in_reason(reason: str) -> float | None:
    """The seconds of a close reason's "retry after N s" (None when it names none)."""
    match = _RETRY_AFTER_REASON.search(reason)
    return float(match.group(1)) if match else None


def handshake_refused(status: int, retry_after: str | None) -> SessionEnd:
    """What a handshake refused with HTTP ``status`` means: a 429 (an ingress's or the
    server's limit) waits as long as Retry-After asks, a 502/503/504 (a server stopping, a
    proxy without a backend) tries the next server, anything else asks the REST API why."""
    detail = f"handshake refused with HTTP {status}"
    if status == 429:
        try:
            seconds = float(retry_after or "")
        except ValueError:
            seconds = None
        return SessionEnd(Action.WAIT, detail, False, seconds)
    if status in UNAVAILABLE_HANDSHAKE:
        return SessionEnd(Action.RECONNECT, detail, False)
    return SessionEnd(Action.DIAGNOSE, detail, False)


class Session:
    """The open socket of the current session; ``send`` encodes in the agreed wire format.

    ``send_soon`` queues an encoded frame for the start of the next loop turn, together
    with every other frame queued in this one: as one ``batch`` frame when the server
    takes them (``batch_frames``, from the registration), else one frame each.  Under load
    several confirmations and outcomes are ready in the same turn; a lone one waits no
    longer than the turn.

    The queued frames are written by a plain callback, straight through the WebSocket
    protocol, not by a task awaiting ``ws.send`` per frame: a task, an async context
    manager and a drain per turn were 14 % of the agent's Python time in a cProfile of tasks
    coming one at a time (docs/performance.md, "Round i17-agent … (session 14)").  When the
    socket pushes back (its write buffer is full), is closing, or is in the middle of a
    fragmented message, the frames go the awaited way instead, in order.
    """

    def __init__(self, ws: ClientConnection, wire_format: str, batch_frames: bool = False) -> None:
        self.ws = ws
        self.wire_format = wire_format
        self.batch_frames = batch_frames
        self.closing_by_us = False
        self.closed = False  # the session ended: queue nothing more on it
        self._queued: list[batching.Encoded] = []
        self._write_scheduled = False
        self._flushing: asyncio.Task | None = None

    async def send(self, frame: dict[str, Any]) -> None:
        await self.ws.send(wire.encode(frame, self.wire_format))

    def send_soon(self, data: batching.Encoded) -> bool:
        """Queue ``data`` (an encoded frame); False when the session is over (send it
        another way).  A frame queued here is lost if the socket drops first, like one
        in the socket's buffer: the caller keeps whatever must survive that."""
        if self.closed:
            return False
        self._queued.append(data)
        # While an awaited flush runs, it takes what is queued meanwhile (order kept).
        if self._flushing is None and not self._write_scheduled:
            self._write_scheduled = True
            asyncio.get_running_loop().call_soon(self._write_queued)
        return True

    def _write_queued(self) -> None:
        self._write_scheduled = False
        if self._flushing is not None or not self._queued:
            return
        if self.closed:
            self._queued.clear()
            return
        ws = self.ws
        if not _writable_now(ws):
            # Back-pressure, a fragmented message, or a closing socket: ws.send waits or
            # raises ConnectionClosed as it should.
            self._flushing = asyncio.get_running_loop().create_task(self._flush())
            return
        queued, self._queued = self._queued, []
        try:
            for data in batching.pack(queued, self.wire_format, self.batch_frames):
                if isinstance(data, str):
                    ws.protocol.send_text(data.encode())
                else:
                    ws.protocol.send_binary(data)
            ws.send_data()
        except Exception:  # noqa: BLE001 - whatever broke the write, the session is over
            log.debug("writing to the delivery socket failed", exc_info=True)
            self.closed = True  # the session loop notices the close and reports it
            ws.transport.abort()

    async def _flush(self) -> None:
        try:
            while self._queued:
                queued, self._queued = self._queued, []
                for data in batching.pack(queued, self.wire_format, self.batch_frames):
                    await self.ws.send(data)
        except (ConnectionClosed, OSError):
            self.closed = True  # the session loop notices the close and reports it
            self._queued.clear()
        finally:
            self._flushing = None

    async def close(self, reason: str = "agent stopping") -> None:
        self.closing_by_us = True
        await self.ws.close(1000, reason)


def _writable_now(ws: ClientConnection) -> bool:
    """Whether frames may be handed to ``ws``'s protocol and written without waiting: open,
    not pushing back, no fragmented message under way.  (Attributes of websockets' asyncio
    connection, pinned in requirements.txt; should one go, frames take the awaited path.)"""
    try:
        return ws.protocol.state is State.OPEN and not ws.paused and ws.send_in_progress is None
    except AttributeError:
        return False


class FrameConnection(ClientConnection):
    """The delivery socket's connection: a whole data message is handed to ``on_message``
    (once the session sets it) in ``data_received`` itself, as the protocol parses it.

    websockets' own path puts each frame into an ``Assembler`` and wakes the task awaiting
    ``recv()``, which takes it in the next loop iteration: a future, a task step and a loop
    iteration per message, on the idle pickup's path ("the agent decoded it") and in every
    result_ack (docs/performance.md, "Round i17-recv").  What is not a whole message in
    one frame (a fragmented one, text that is not UTF-8), and every message while one is
    still queued for ``recv()``, takes websockets' path, so messages keep their order and
    bad data is refused exactly as before.  ``on_message`` must not block; what it raises
    ends the session (``handler_error``, raised by :func:`run_session`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_message: Callable[[str | bytes], None] | None = None
        self.handler_error: Exception | None = None
        self._queued_messages = 0  # messages (whole or begun) put into the assembler

    def process_event(self, event: Event) -> None:
        if self.response is None or not self._handled_here(event):
            super().process_event(event)

    def _handled_here(self, frame: Event) -> bool:
        if not isinstance(frame, Frame):
            return False
        opcode = frame.opcode
        if opcode is not Opcode.BINARY and opcode is not Opcode.TEXT:
            return False  # continuations and control frames: websockets' own handling
        handler = self.on_message
        if handler is None or self._queued_messages or not frame.fin or self.handler_error:
            self._queued_messages += 1
            return False
        data = frame.data
        if opcode is Opcode.TEXT:
            try:
                message: str | bytes = bytes(data).decode()
            except UnicodeDecodeError:
                self._queued_messages += 1  # recv() fails the connection as it always did
                return False
        else:
            message = data if type(data) is bytes else bytes(data)
        try:
            handler(message)
        except Exception as exc:  # noqa: BLE001 - raised again by run_session
            self.handler_error = exc
            self.transport.abort()
        return True

    async def recv(self, decode: bool | None = None) -> str | bytes:
        message = await super().recv(decode)
        self._queued_messages -= 1
        return message


def batched_frames(frame: dict[str, Any]) -> list[dict[str, Any]]:
    """The frames of a server's ``batch`` frame that an agent takes (``work``,
    ``result_ack``), in order; a batch over the bounds, and anything else in one, is
    ignored (logged): a packet never confirmed is pushed again, an outcome never
    acknowledged is reported again."""
    inner = frame.get(wire.BATCH_FIELD)
    if not isinstance(inner, list) or len(inner) > frames.MAX_BATCH_FRAMES:
        log.warning(
            "ignoring a batch frame from the server: not a list of at most %d frames",
            frames.MAX_BATCH_FRAMES,
        )
        return []
    taken = [f for f in inner if f.get("type") in frames.SERVER_BATCHABLE]
    if len(taken) < len(inner):
        log.warning(
            "ignoring %d frame(s) of a batch: not work or result_ack", len(inner) - len(taken)
        )
    return taken


async def open_socket(
    url: str,
    api_key: str,
    ssl_context: ssl.SSLContext | None = None,
    ping_every_s: float = MIN_PING_INTERVAL_S,
) -> ClientConnection:
    """The WebSocket at ``url``, opened with the agent's key (the handshake's errors raise:
    websockets' InvalidStatus, InvalidURI, InvalidHandshake, OSError, TimeoutError), pinging
    every ``ping_every_s`` (:func:`ping_interval_s`)."""
    tls = {"ssl": ssl_context} if ssl_context is not None and url.startswith("wss:") else {}
    return await connect(
        url,
        proxy=_proxy(url),
        additional_headers={"Authorization": f"Bearer {api_key}"},
        open_timeout=OPEN_TIMEOUT_S,
        max_size=MAX_INCOMING_FRAME_BYTES,
        user_agent_header="cloacina-agent",
        ping_interval=ping_every_s,
        ping_timeout=PING_TIMEOUT_S,
        create_connection=FrameConnection,
        **tls,
    )


def _proxy(url: str) -> str | None:
    """The proxy for the server at ``url`` (None: none), as websockets finds it: from the
    environment (``ws_proxy``, ``https_proxy``, ``no_proxy``, …), read once per server."""
    uri = parse_uri(url)
    return _proxy_of(uri.secure, uri.host, uri.port)


@functools.cache
def _proxy_of(secure: bool, host: str, port: int) -> str | None:
    # websockets reads (and decodes) the whole environment on every connect to find it:
    # a tenth of the swarm's CPU per connecting agent.  A process's proxy settings do not
    # change while it runs.
    return get_proxy(WebSocketURI(secure, host, port, "/", ""))


async def run_session(
    url: str,
    api_key: str,
    wire_format: str,
    on_open: Callable[[Session], Awaitable[None]],
    on_frame: Callable[[dict[str, Any]], None],
    on_close: Callable[[], None],
    ssl_context: ssl.SSLContext | None = None,
    batch_frames: bool = False,
    ping_every_s: float = MIN_PING_INTERVAL_S,
    opened: ClientConnection | None = None,
) -> SessionEnd:
    """Connect to ``url``, call ``on_open`` (send hello), feed frames until the socket ends.

    ``on_frame`` takes each decoded frame synchronously, mostly from the socket's
    ``data_received`` (:class:`FrameConnection`): it must not block.
    ``ssl_context`` verifies a ``wss://`` server (the REST client's, so both trust the same CA);
    ``batch_frames``: the server takes ``batch`` frames (its registration answer said so);
    ``ping_every_s``: seconds between keepalive pings (:func:`ping_interval_s`);
    ``opened``: the socket the agent just registered on, used instead of connecting.
    """
    try:
        ws = opened or await open_socket(url, api_key, ssl_context, ping_every_s)
        # A socket opened to register was opened before the registration's answer said
        # the liveness window: websockets reads the interval before each sleep.
        ws.ping_interval = ping_every_s
    except InvalidStatus as exc:
        return handshake_refused(exc.response.status_code, exc.response.headers.get("Retry-After"))
    except InvalidURI as exc:
        return SessionEnd(Action.AUTH_FAILED, f"bad WebSocket URL: {exc}", False)
    except (OSError, TimeoutError, InvalidHandshake, EOFError) as exc:
        return SessionEnd(Action.RECONNECT, f"cannot connect: {type(exc).__name__}: {exc}", False)
    session = Session(ws, wire_format, batch_frames)
    dispatch = functools.partial(_dispatch, wire_format, on_frame)
    try:
        await on_open(session)
        if isinstance(ws, FrameConnection):
            ws.on_message = dispatch  # from now on, whole messages as they are parsed
        async for message in ws:  # the rest: fragmented, queued before, or not UTF-8
            dispatch(message)
    except ConnectionClosed:
        pass  # the close code below says what happened
    except OSError as exc:
        return SessionEnd(Action.RECONNECT, f"socket error: {exc}", True)
    finally:
        session.closed = True
        if isinstance(ws, FrameConnection):
            ws.on_message = None
        on_close()
        if ws.state.name != "CLOSED":
            await ws.close()
    handler_error = getattr(ws, "handler_error", None)
    if handler_error is not None:
        raise handler_error  # as if raised by on_frame in this task
    if session.closing_by_us:
        return SessionEnd(Action.CLOSED_BY_US, "closed by the agent", True)
    code, reason = ws.close_code, ws.close_reason or ""
    detail = f"closed by the server ({code}: {reason})" if reason else f"lost ({code})"
    return SessionEnd(action_for_close(code), detail, True, retry_after_in_reason(reason))


def _dispatch(
    wire_format: str, on_frame: Callable[[dict[str, Any]], None], message: str | bytes
) -> None:
    """Decode one message and hand its frame (a batch's frames, in order) to ``on_frame``;
    a frame the wire format refuses is logged and ignored."""
    try:
        frame = wire.decode(message, wire_format)
        if not isinstance(frame.get("type"), str):
            raise wire.WireFormatError("frame has no string 'type'")
    except wire.WireFormatError as exc:
        log.warning("ignoring a frame from the server: %s", exc)
        return
    if frame["type"] == wire.BATCH:
        for inner in batched_frames(frame):
            on_frame(inner)
    else:
        on_frame(frame)
