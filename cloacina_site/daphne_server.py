"""daphne's ``Server`` with its two per-connection sweeps sized for thousands of sockets.

daphne walks every connection it holds twice on a timer, whether or not anything happened
(docs/scaling.md, "Idle CPU"):

* ``application_checker``, every second: reaps the application of a connection that ended
  and cancels one that outlived its connection by ``application_close_timeout``;
* ``timeout_checker``, every 2 s: a WebSocket still in its handshake past its connect
  timeout is refused, an open one silent for ``ping_interval`` is pinged, one older than
  ``websocket_timeout`` is closed; an HTTP request past ``http_timeout`` gets a 503.

At 5,000 agents each socket is visited 1.5 times a second for nothing: about 15 % of an
idle server's CPU.  The intervals are hard-coded in daphne.  :class:`FleetServer` does the
same work, differently:

* the application checker visits only the connections that changed since its last round
  (disconnected, or their application finished), and those still waiting for their
  application to end after a disconnect; what it does to each is daphne's own code;
* the timeout checker runs every :data:`TIMEOUT_SWEEP_S` seconds and skips HTTP requests
  when ``http_timeout`` is off (``serve`` never sets it: nothing of theirs can time out).
  A silent socket is pinged 20–25 s after its last frame instead of 20–22 s; an agent
  beats every 15 s, so its socket is never silent that long.

It also offers each WebSocket application a **frame shortcut** (the scope's
:data:`~agents.surface.consumers.FRAME_SHORTCUT`): a function through which the application
installs a synchronous handler that daphne's reader calls with each frame before queueing it
(cloacina_site/daphne_limits.py).  The agents' delivery socket takes its heartbeats there:
thousands of agents beat every 15 s, and each beat through the application's queue cost a
queue round, a wake-up of the consumer's task and Channels' dispatch (docs/scaling.md).

And it writes no access-log line that nobody reads: at daphne's verbosity 1 (``serve``'s)
Twisted's log goes to a null observer, yet Twisted's HTTP factory still formatted a
combined-log line for every request and sent it through the log machinery to be dropped
(docs/performance.md, "Round i17-start").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from daphne.http_protocol import WebRequest
from daphne.server import Server
from twisted.internet import reactor

from agents.surface.consumers import FRAME_SHORTCUT

daphne_log = logging.getLogger("daphne.server")  # daphne's own lines, under daphne's name

APPLICATION_CHECK_S = 1.0  # daphne's interval
TIMEOUT_SWEEP_S = 5.0  # daphne's: 2 s


class FleetServer(Server):
    """``daphne.server.Server`` with incremental application checks (see the module)."""

    def run(self) -> None:
        # Connections to look at on the next application check: disconnected, or their
        # application done.  Filled by the hooks below, emptied by the check.
        self.unsettled: set[Any] = set()
        reactor.callWhenRunning(self.quiet_access_log)  # after run() made and started the factory
        super().run()

    def quiet_access_log(self) -> None:
        """No access-log line per HTTP request when Twisted's log goes nowhere (daphne's
        verbosity 1 or less): the factory without a log file skips the line (Twisted's own
        "no access log" state); at a higher verbosity the lines still go to Python's log."""
        if self.verbosity <= 1:
            self.http_factory.logFile = None

    # -- hooks that note what changed ----------------------------------------------------
    def protocol_disconnected(self, protocol: Any) -> None:
        super().protocol_disconnected(protocol)
        self.unsettled.add(protocol)

    def create_application(self, protocol: Any, scope: dict):
        if scope.get("type") == "websocket":
            scope[FRAME_SHORTCUT] = partial(install_frame_shortcut, protocol)
        queue = super().create_application(protocol, scope)
        details = self.connections.get(protocol)
        instance = details.get("application_instance") if details else None
        if instance is not None:
            instance.add_done_callback(lambda _: self.unsettled.add(protocol))
        return queue

    # -- the sweeps ------------------------------------------------------------------------
    def application_checker(self) -> None:
        """daphne's check, for the connections that changed (and those still settling)."""
        pending, self.unsettled = self.unsettled, set()
        for protocol in pending:
            if protocol in self.connections and not self.settle(protocol):
                self.unsettled.add(protocol)  # its application has not ended yet
        reactor.callLater(APPLICATION_CHECK_S, self.application_checker)

    def settle(self, protocol: Any) -> bool:
        """daphne's ``application_checker`` body for one connection: cancel an application
        that outlived its connection by ``application_close_timeout``, reap (and report) a
        finished one, forget a connection that is closed with its application gone.  True
        when nothing is left to wait for."""
        details = self.connections[protocol]
        disconnected = details.get("disconnected", None)
        application_instance = details.get("application_instance", None)
        if disconnected and time.time() - disconnected > self.application_close_timeout:
            if application_instance and not application_instance.done():
                daphne_log.warning(
                    "Application instance %r for connection %s took too long to shut down "
                    "and was killed.",
                    application_instance,
                    repr(protocol),
                )
                application_instance.cancel()
        if application_instance and application_instance.done():
            self.reap(protocol, application_instance, disconnected)
            del self.connections[protocol]["application_instance"]
            application_instance = None
        if not application_instance and disconnected:
            del self.connections[protocol]
            return True
        # Still open (checked again when it disconnects) or its application still ending.
        return not disconnected

    def reap(self, protocol: Any, application_instance, disconnected: float | None) -> None:
        """What daphne does with a finished application: report its exception."""
        if application_instance.cancelled():
            return
        exception = application_instance.exception()
        if exception is None:
            return
        if isinstance(exception, KeyboardInterrupt):
            self.stop()  # the protocol asks the server to exit (tests)
            return
        daphne_log.error("Exception inside application: %s", exception, exc_info=exception)
        if not disconnected:
            protocol.handle_exception(exception)

    def timeout_checker(self) -> None:
        """daphne's timeout sweep, every TIMEOUT_SWEEP_S, without the HTTP requests when
        they have no timeout."""
        skip_http = not self.http_timeout
        for protocol in list(self.connections):
            if skip_http and isinstance(protocol, WebRequest):
                continue
            protocol.check_timeouts()
        reactor.callLater(TIMEOUT_SWEEP_S, self.timeout_checker)


def install_frame_shortcut(protocol: Any, handler: Callable[[bytes, bool], bool]) -> None:
    """Have ``protocol``'s reader offer each received frame to ``handler`` (payload, whether
    binary) before queueing it for the application; a frame the handler takes (True) is not
    queued (daphne_limits' ``onMessage``)."""
    protocol.frame_shortcut = handler
