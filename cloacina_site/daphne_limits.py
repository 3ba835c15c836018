"""What daphne lets one client make the server hold, and what it tells a client it closes.

Three adjustments to daphne (pinned in requirements.txt), applied by `serve`:

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
* **Close reasons.**  Daphne sent only the close code; the reason a consumer
  gives (``malformed frame: …``) now reaches the agent too.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

HIGH_WATER = 32  # frames queued for a consumer before its socket stops being read
LOW_WATER = 8  # …and read again once the consumer is down to this many
RESUME_CHECK_S = 0.005
CLOSE_REASON_MAX_BYTES = 123  # the WebSocket close frame's limit


def apply_daphne_limits() -> None:
    """Install all three (idempotent)."""
    from daphne import http_protocol, ws_protocol

    _formless_requests(http_protocol.WebRequest)
    _bounded_websockets(ws_protocol.WebSocketProtocol)


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
    protocol_class.onMessage = onMessage
    protocol_class.handle_reply = handle_reply
    protocol_class._cloacina_bounded = True


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
