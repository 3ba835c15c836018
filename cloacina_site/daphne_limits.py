"""What daphne lets one client make the server hold, and what it tells a client it closes.

Seven adjustments to daphne (pinned in requirements.txt), applied by `serve`:

* **Request bodies capped as they arrive.**  Twisted buffers a whole request body
  (to memory, then a temporary file) before daphne hands it to Django, so before
  authentication: any client could make the server store gigabytes.  A body
  declared (``Content-Length``) or streamed (``Transfer-Encoding: chunked``) past
  the cap — the largest legitimate body, see ``Config.max_request_bytes`` — is
  answered ``413`` with a JSON ``detail`` the moment it crosses the line; what
  the client still sends is read and thrown away for a short linger (so it can
  read the answer rather than a connection reset), then the connection closes.

* **No Twisted form parsing.**  Twisted's ``http.Request`` parses every
  ``multipart/form-data`` POST into ``request.args`` before daphne sees it: a
  second in-memory copy of each package upload that daphne never reads, and for
  a body it cannot parse a bare ``400`` with no body — answered before Django,
  so before authentication and the API's JSON errors.  Django parses bodies itself.
* **Back-pressure on WebSockets.**  Daphne puts every received frame on the
  application's queue, which has no bound: an agent sending faster than its
  consumer handles frames grew the server by a gigabyte in seconds.  Past
  ``HIGH_WATER`` queued frames the socket is no longer read (TCP then slows the
  sender) until the consumer has worked the queue down to ``LOW_WATER``.
  A frame the application's frame shortcut takes (cloacina_site/daphne_server.py) is
  handled there and then, never queued; the shortcut is offered a frame only when nothing
  of the socket is queued ahead of it, so frames are still handled in their order.
* **Close reasons.**  Daphne sent only the close code; the reason a consumer
  gives (``malformed frame: …``) now reaches the agent too.
* **Idle keep-alive connections closed.**  Twisted keeps an idle HTTP/1.1 connection
  open for twelve hours.  Every agent registers over REST and then lives on its
  WebSocket, so each left the server an idle REST connection (a socket, a channel and
  its buffers) for good: at thousands of agents, a large share of the server's memory
  per agent.  One idle for ``CLOACINA_HTTP_KEEPALIVE_S`` (30 s) between requests is now closed (a
  request in progress, and a WebSocket upgraded from one, are never timed out: Twisted
  suspends the idle timer while it handles a request).  Clients reconnect when they
  next call; httpx, the agents' client, drops a connection idle for 5 s itself.
* **Lean WebSocket connections** (autobahn, under daphne).  Each connection copied the
  factory's 29 protocol options onto itself (a larger ``__dict__`` per socket, thousands
  of sockets) and built its debug lines — a ``pformat`` of those options per connection,
  highlighted type names per frame received — whether or not debug was logged.  The
  options now live on the protocol class (the values the factory gives, read the same
  way), and those debug arguments are formatted only when a debug line is written.
* **One frame per read, read lean** (autobahn, under daphne).  An idle agent's socket
  brings one small masked frame per read — its heartbeat, thousands a minute at thousands
  of agents, or its ping — and autobahn's general frame state machine took a third of an
  idle server's busy time over them (a frame header object, a masker object, a dozen
  hooks, an event fired with a future for listeners nobody registered; docs/scaling.md,
  "Round i16-beat2").  A read that holds exactly one complete, final, masked,
  uncompressed binary frame of at most :data:`LEAN_MAX_BYTES`, or ping, on an open socket
  with no frame or message in progress and an application that took the frame shortcut,
  is unmasked here and handed to ``onMessage`` (or ``_onPing``, which answers the pong) as
  autobahn would hand it; anything else — a text frame, a close, a fragment, two frames
  or part of one in a read, a frame over the size limits — goes autobahn's way
  untouched, which checks it and closes with the same codes as before.
"""

from __future__ import annotations

import json
import logging
import time
import types
from collections.abc import Callable
from io import BytesIO
from typing import Any

log = logging.getLogger(__name__)

HIGH_WATER = 32  # frames queued for a consumer before its socket stops being read
LOW_WATER = 8  # …and read again once the consumer is down to this many
RESUME_CHECK_S = 0.005
CLOSE_REASON_MAX_BYTES = 123  # the WebSocket close frame's limit
# After a 413 the rest of the body is discarded until the client has been quiet this
# long (it has stopped sending and is reading the answer), and never longer than
# LINGER_MAX_S: closing on unread data would make the kernel send a reset, and many
# clients then report "connection reset" instead of the 413.
LINGER_IDLE_S = 2.0
LINGER_MAX_S = 30.0
# Frames read lean (one_lean_frame): the agents' heartbeats (~300 bytes) and the other
# small frames of a delivery socket; a larger one is rare and goes autobahn's way.
LEAN_MAX_BYTES = 8 * 1024
_FINAL = 0x80  # the FIN bit, no RSV bit (nothing compressed)
_MASKED = 0x80
BINARY, PING = 0x2, 0x9  # the opcodes read lean


def apply_daphne_limits(
    max_body_bytes: int | None = None, keepalive_s: float | None = None
) -> None:
    """Install all seven (idempotent); ``max_body_bytes`` None leaves bodies uncapped,
    ``keepalive_s`` None leaves Twisted's idle timeout (twelve hours)."""
    from daphne import http_protocol, ws_protocol

    _formless_requests(http_protocol.WebRequest)
    _bounded_websockets(ws_protocol.WebSocketProtocol)
    _lean_frames(ws_protocol.WebSocketProtocol)
    if keepalive_s is not None:
        _idle_keepalive_closed(http_protocol.HTTPFactory, keepalive_s)
    _lean_websockets(ws_protocol.WebSocketFactory)
    if max_body_bytes is not None:
        _capped_bodies(http_protocol.WebRequest, max_body_bytes)


def body_too_large_detail(limit: int) -> str:
    return (
        f"the request body is over the {limit}-byte limit of this server "
        "(the largest package, CLOACINA_MAX_PACKAGE_BYTES, or context, "
        "CLOACINA_MAX_CONTEXT_BYTES, plus 1 MiB)"
    )


def _capped_bodies(request_class, limit: int) -> None:
    request_class._cloacina_body_limit = limit  # a later call (tests) may change the cap
    if getattr(request_class, "_cloacina_capped", False):
        return
    original_got_length = request_class.gotLength
    original_chunk = request_class.handleContentChunk
    original_received = request_class.requestReceived

    def gotLength(self, length):
        self._cloacina_received = 0
        self._cloacina_refused = False
        if length is not None and length > self._cloacina_body_limit:
            # Refused on the header alone: no body is read, and no "100 Continue" invites it.
            self.requestHeaders.removeHeader(b"Expect")
            self.content = BytesIO()
            _refuse(self)
            return
        original_got_length(self, length)

    def handleContentChunk(self, data):
        if self._cloacina_refused:
            return
        self._cloacina_received += len(data)
        if self._cloacina_received > self._cloacina_body_limit:
            self.content.close()  # the temporary file and what it held go now
            self.content = BytesIO()
            _refuse(self)
            return
        original_chunk(self, data)

    def requestReceived(self, command, path, version):
        if getattr(self, "_cloacina_refused", False):
            return  # answered already; the application never sees this request
        original_received(self, command, path, version)

    request_class.gotLength = gotLength
    request_class.handleContentChunk = handleContentChunk
    request_class.requestReceived = requestReceived
    request_class._cloacina_capped = True


def _refuse(request) -> None:
    """Answer 413 straight on the connection, then linger, discarding what still comes."""
    request._cloacina_refused = True
    channel = request.channel
    body = json.dumps({"detail": body_too_large_detail(request._cloacina_body_limit)}).encode()
    channel.transport.write(
        b"HTTP/1.1 413 Content Too Large\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n"
        b"Connection: close\r\n\r\n" + body
    )
    log.warning(
        "refused a request body over %d bytes from %s",
        request._cloacina_body_limit,
        channel.transport.getPeer(),
    )
    _Linger(channel).start()


class _Linger:
    """Reads and drops a refused request's remaining bytes, then closes the connection."""

    def __init__(self, channel) -> None:
        self.channel = channel
        self.idle = None
        self.deadline = None

    def start(self) -> None:
        from twisted.internet import reactor

        # The channel parses no more: every byte from now on goes here, and is dropped.
        self.channel.dataReceived = self.data_received
        self.channel.setTimeout(None)
        self.idle = reactor.callLater(LINGER_IDLE_S, self.close)
        self.deadline = reactor.callLater(LINGER_MAX_S, self.close)

    def data_received(self, data: bytes) -> None:
        if self.idle is not None and self.idle.active():
            self.idle.reset(LINGER_IDLE_S)

    def close(self) -> None:
        for call in (self.idle, self.deadline):
            if call is not None and call.active():
                call.cancel()
        transport = self.channel.transport
        if transport is not None:
            transport.loseConnection()


class _LazyText:
    """A log argument computed only when the line is formatted (never, below its level)."""

    __slots__ = ("args", "make")

    def __init__(self, make: Callable[..., Any], args: tuple) -> None:
        self.make, self.args = make, args

    def __str__(self) -> str:
        return str(self.make(*self.args))

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def _lazy(make: Callable[..., Any]) -> Callable[..., _LazyText]:
    return lambda *args: _LazyText(make, args)


def _lean_websockets(factory_class) -> None:
    if getattr(factory_class, "_cloacina_lean", False):
        return
    # Local, as daphne's own modules above: only `serve` (after daphne installed its
    # reactor) patches them.
    from autobahn.twisted import websocket as twisted_websocket
    from autobahn.websocket import protocol as websocket_protocol

    for module in (twisted_websocket, websocket_protocol):
        for name in ("hltype", "hlval", "pformat"):
            if hasattr(module, name):
                setattr(module, name, _lazy(getattr(module, name)))
    protocol_class = factory_class.protocol
    # The options autobahn would copy onto each connection: those the class does not set.
    copied = [name for name in protocol_class.CONFIG_ATTRS if not hasattr(protocol_class, name)]
    original_build = factory_class.buildProtocol

    def buildProtocol(self, addr):
        if protocol_class.__dict__.get("_cloacina_options_of") is not self:
            for name in copied:  # this factory's values, as autobahn reads them
                value = getattr(self, name)
                # A plain function (perMessageCompressionAccept) would bind as a method.
                if isinstance(value, types.FunctionType):
                    value = staticmethod(value)
                setattr(protocol_class, name, value)
            protocol_class._cloacina_options_of = self
        return original_build(self, addr)

    factory_class.buildProtocol = buildProtocol
    factory_class._cloacina_lean = True


def _idle_keepalive_closed(factory_class, keepalive_s: float) -> None:
    """Twisted's HTTPFactory gives each connection its ``timeOut`` as the idle timeout."""
    factory_class._cloacina_keepalive_s = keepalive_s  # a later call (tests) may change it
    if getattr(factory_class, "_cloacina_keepalive", False):
        return
    original_init = factory_class.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.timeOut = self._cloacina_keepalive_s

    factory_class.__init__ = __init__
    factory_class._cloacina_keepalive = True


def _formless_requests(request_class) -> None:
    if getattr(request_class, "_cloacina_formless", False):
        return
    original_init = request_class.__init__

    def __init__(self, *args, **kwargs):
        kwargs["parsePOSTFormSubmission"] = False
        original_init(self, *args, **kwargs)

    request_class.__init__ = __init__
    request_class._cloacina_formless = True


def _bounded_websockets(protocol_class) -> None:
    if getattr(protocol_class, "_cloacina_bounded", False):
        return
    original_on_message = protocol_class.onMessage
    original_handle_reply = protocol_class.handle_reply

    def onMessage(self, payload, isBinary):
        shortcut = self.frame_shortcut
        if (
            shortcut is not None
            and not self.muted
            and not self.application_queue.qsize()  # nothing ahead of it
            and shortcut(payload, isBinary)
        ):
            self.last_ping = time.time()  # as daphne's onMessage: its ping sweep reads it
            return
        original_on_message(self, payload, isBinary)
        queue = getattr(self, "application_queue", None)
        if queue is not None and queue.qsize() >= HIGH_WATER and not self._cloacina_paused:
            self._cloacina_paused = True
            self.transport.pauseProducing()
            _resume_when_drained(self)

    def handle_reply(self, message):
        if message.get("type") == "websocket.close" and message.get("reason"):
            if self.state not in (self.STATE_CONNECTING, self.STATE_CLOSING, self.STATE_CLOSED):
                reason = message["reason"].encode()[:CLOSE_REASON_MAX_BYTES]
                self.sendClose(
                    code=message.get("code") or 1000,
                    reason=reason.decode(errors="ignore"),
                )
                return
        original_handle_reply(self, message)

    protocol_class._cloacina_paused = False
    protocol_class.frame_shortcut = None  # set per connection by its application
    protocol_class.onMessage = onMessage
    protocol_class.handle_reply = handle_reply
    protocol_class._cloacina_bounded = True


def one_lean_frame(
    data: bytes, max_frame: int = 0, max_message: int = 0
) -> tuple[int, bytes] | None:
    """(opcode, unmasked payload) when ``data`` is exactly one complete, final, masked
    WebSocket frame with no RSV bit that is either binary (:data:`BINARY`, a payload of 1 to
    LEAN_MAX_BYTES bytes within ``max_frame``/``max_message``, 0: no limit, as autobahn reads
    them) or a ping (:data:`PING`, 1 to 125 bytes), each length in its minimal encoding;
    None for anything else, which autobahn's parser then reads (RFC 6455 section 5.2)."""
    frame = _lean_frame_at(data, 0, max_frame, max_message)
    if frame is None or frame[2] != len(data):
        return None
    return frame[0], frame[1]


def lean_frames(
    data: bytes, max_frame: int = 0, max_message: int = 0
) -> list[tuple[int, bytes, int]] | None:
    """(opcode, unmasked payload, end offset) of each frame when ``data`` is one or more
    complete frames that :func:`one_lean_frame` would read, back to back; None for anything
    else.  Under load an agent's ``received`` and its result (and a beat) arrive in one
    read: round i17-relay counted 60 % of fleetbench's frames in reads of 2–5 frames, all
    complete, which autobahn's parser read."""
    frames = []
    offset = 0
    while offset < len(data):
        frame = _lean_frame_at(data, offset, max_frame, max_message)
        if frame is None:
            return None
        frames.append(frame)
        offset = frame[2]
    return frames or None


def _lean_frame_at(
    data: bytes, offset: int, max_frame: int, max_message: int
) -> tuple[int, bytes, int] | None:
    """The frame :func:`one_lean_frame` reads, starting at ``offset`` and complete within
    ``data``: (opcode, payload, its end offset); None for anything else."""
    if len(data) - offset < 7:
        return None
    first, second = data[offset], data[offset + 1]
    if not second & _MASKED or (first != _FINAL | BINARY and first != _FINAL | PING):
        return None
    size = second & 0x7F
    if size < 126:
        start = offset + 6
    elif size == 126 and first == _FINAL | BINARY:  # a control frame never has 126
        size = int.from_bytes(data[offset + 2 : offset + 4], "big")
        if size < 126:  # not the minimal encoding: autobahn fails it
            return None
        start = offset + 8
    else:  # 8-byte lengths: over LEAN_MAX_BYTES
        return None
    end = start + size
    if end > len(data) or size > LEAN_MAX_BYTES or 0 < max_frame < size or 0 < max_message < size:
        return None
    key = (data[start - 4 : start] * ((size + 3) // 4))[:size]
    masked = int.from_bytes(data[start:end], "little") ^ int.from_bytes(key, "little")
    return first & 0x0F, masked.to_bytes(size, "little"), end


def _lean_frames(protocol_class) -> None:
    if getattr(protocol_class, "_cloacina_lean_frames", False):
        return
    original_data_received = protocol_class.dataReceived

    def lean_ready(self) -> bool:
        """Autobahn's parser holds nothing and would only hand this socket's frames on."""
        return (
            self.frame_shortcut is not None  # a delivery socket past its connect
            and self.state == self.STATE_OPEN
            and not self.data  # nothing of an earlier read waits to be parsed
            and self.current_frame is None
            and not self.inside_message
            and not self.failedByMe
            and not self.trackedTimings
            and not self.logFrames
            and not self.logOctets
            and self._listeners is None  # nobody to fire "message" to
            and self._parent is None
        )

    def dataReceived(self, data):
        frames = None
        if lean_ready(self):
            frames = lean_frames(data, self.maxFramePayloadSize, self.maxMessagePayloadSize)
        if frames is None:
            original_data_received(self, data)
            return
        # What autobahn counts for such frames, then what it calls for each: onMessage (the
        # shortcut, or daphne's queue with the back-pressure above) or _onPing.
        stats = self.trafficStats
        stats.incomingOctetsWireLevel += len(data)  # per read, as autobahn counts it
        offset = 0
        for opcode, payload, end in frames:
            if offset and not lean_ready(self):  # the frame before closed it, say
                rest = data[offset:]
                if self.state == self.STATE_OPEN:
                    stats.incomingOctetsWireLevel -= len(rest)  # autobahn counts it again
                original_data_received(self, rest)  # autobahn, from a frame's start
                return
            offset = end
            if opcode == PING:
                self._onPing(payload)
                continue
            stats.incomingOctetsWebSocketLevel += len(payload)
            stats.incomingOctetsAppLevel += len(payload)
            stats.incomingWebSocketFrames += 1
            stats.incomingWebSocketMessages += 1
            self.onMessage(payload, True)

    protocol_class.dataReceived = dataReceived
    protocol_class._cloacina_lean_frames = True


def _resume_when_drained(protocol) -> None:
    from twisted.internet import reactor

    queue = getattr(protocol, "application_queue", None)
    if protocol.state == protocol.STATE_CLOSED or queue is None or queue.qsize() <= LOW_WATER:
        protocol._cloacina_paused = False
        try:
            protocol.transport.resumeProducing()
        except Exception:  # the connection went away meanwhile
            log.debug("could not resume a websocket", exc_info=True)
        return
    reactor.callLater(RESUME_CHECK_S, _resume_when_drained, protocol)


def _open_websockets(server, path_prefix: bytes) -> list:
    """The server's WebSocket connections under ``path_prefix`` that are still open."""
    from daphne.ws_protocol import WebSocketProtocol  # lazy: daphne installs its reactor

    return [
        protocol
        for protocol in list(server.connections)
        if isinstance(protocol, WebSocketProtocol)
        and getattr(protocol, "path", b"").startswith(path_prefix)
        and protocol.state == protocol.STATE_OPEN
    ]


def close_websockets(server, path_prefix: bytes, code: int, reason: str) -> int:
    """Send a close frame (``code``, ``reason``) on every open WebSocket of ``server``
    under ``path_prefix``, now, from the reactor thread; how many.

    At shutdown this must run before daphne's own "before shutdown" trigger, which
    cancels every application at once: a consumer asked to close after that never
    runs, and its client sees the connection drop (1006) instead of the reason.
    """
    sockets = _open_websockets(server, path_prefix)
    clipped = reason.encode()[:CLOSE_REASON_MAX_BYTES].decode(errors="ignore")
    for protocol in sockets:
        protocol.sendClose(code=code, reason=clipped)
    return len(sockets)


def websockets_closing(server, path_prefix: bytes) -> int:
    """How many WebSockets under ``path_prefix`` have not finished closing yet."""
    from daphne.ws_protocol import WebSocketProtocol  # lazy: daphne installs its reactor

    return sum(
        1
        for protocol in list(server.connections)
        if isinstance(protocol, WebSocketProtocol)
        and getattr(protocol, "path", b"").startswith(path_prefix)
        and protocol.state != protocol.STATE_CLOSED
    )
