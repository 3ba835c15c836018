"""`serve`'s daphne server (cloacina_site/daphne_server.py): its application check visits
only the connections that changed, and does to them what daphne does; its timeout sweep
skips HTTP requests that cannot time out.  Driven with stand-in connections (integration:
importing daphne installs Twisted's asyncio reactor in the process)."""

from __future__ import annotations

import asyncio
import time

import pytest
from daphne.http_protocol import HTTPFactory, WebRequest

from agents.surface.consumers import FRAME_SHORTCUT
from cloacina_site import daphne_limits, daphne_server
from cloacina_site.daphne_server import APPLICATION_CHECK_S, TIMEOUT_SWEEP_S, FleetServer


class Connection:
    """A protocol as daphne's server sees it."""

    def __init__(self) -> None:
        self.exceptions: list[BaseException] = []
        self.timeout_checks = 0

    def handle_exception(self, exception: BaseException) -> None:
        self.exceptions.append(exception)

    def check_timeouts(self) -> None:
        self.timeout_checks += 1


class HttpConnection(Connection, WebRequest):
    def __init__(self) -> None:  # no Twisted channel: only its class matters here
        Connection.__init__(self)


class Reactor:
    def __init__(self) -> None:
        self.later: list[tuple[float, object]] = []

    def callLater(self, delay: float, fn) -> None:
        self.later.append((delay, fn))


@pytest.fixture
def reactor(monkeypatch) -> Reactor:
    fake = Reactor()
    monkeypatch.setattr(daphne_server, "reactor", fake)
    return fake


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def server(http_timeout: float | None = None) -> FleetServer:
    made = FleetServer(application=None, endpoints=["tcp:port=0"], http_timeout=http_timeout)
    made.connections, made.unsettled = {}, set()  # what run() sets up
    return made


def connect(made: FleetServer, loop, app: asyncio.Future | None = None) -> Connection:
    connection = Connection()
    made.protocol_connected(connection)
    if app is not None:
        made.connections[connection]["application_instance"] = app
        app.add_done_callback(lambda _: made.unsettled.add(connection))
    return connection


@pytest.mark.parametrize("verbosity, logged", [(1, 0), (2, 1)])
def test_no_access_log_line_is_formatted_when_twisteds_log_goes_nowhere(verbosity, logged):
    made = FleetServer(application=None, endpoints=["tcp:port=0"], verbosity=verbosity)
    made.http_factory = HTTPFactory(made)  # what run() makes and starts before the reactor runs
    made.http_factory.startFactory()
    lines: list[object] = []
    made.http_factory._logFormatter = lambda when, request: lines.append(request) or "line"
    try:
        made.quiet_access_log()
        made.http_factory.log(object())
    finally:
        made.http_factory.stopFactory()
    assert len(lines) == logged


def test_open_connections_are_not_visited_and_the_check_runs_every_second(reactor, loop):
    made = server()
    visited: list[object] = []
    made.settle = lambda protocol: visited.append(protocol) or True
    for _ in range(100):
        connect(made, loop, loop.create_future())
    made.application_checker()
    assert visited == []
    assert reactor.later == [(APPLICATION_CHECK_S, made.application_checker)]


def test_a_disconnected_connection_is_forgotten_once_its_application_ends(reactor, loop):
    made = server()
    app = loop.create_future()
    connection = connect(made, loop, app)
    made.protocol_disconnected(connection)
    made.application_checker()
    assert connection in made.connections  # its application is still ending
    assert made.unsettled == {connection}  # and it is looked at again next round
    app.set_result(None)
    loop.run_until_complete(asyncio.sleep(0))  # the done callback
    made.application_checker()
    assert connection not in made.connections
    assert made.unsettled == set()


def test_an_application_outliving_its_connection_is_cancelled(reactor, loop):
    made = server()
    app = loop.create_future()
    connection = connect(made, loop, app)
    made.protocol_disconnected(connection)
    made.connections[connection]["disconnected"] = time.time() - made.application_close_timeout - 1
    made.application_checker()
    assert app.cancelled()
    loop.run_until_complete(asyncio.sleep(0))
    made.application_checker()
    assert connection not in made.connections


def test_an_application_that_failed_is_reported_to_its_open_connection(reactor, loop):
    made = server()
    app = loop.create_future()
    connection = connect(made, loop, app)
    failure = RuntimeError("boom")
    app.set_exception(failure)
    loop.run_until_complete(asyncio.sleep(0))
    made.application_checker()
    assert connection.exceptions == [failure]
    assert "application_instance" not in made.connections[connection]  # reaped
    assert made.unsettled == set()  # not visited again until it disconnects
    made.protocol_disconnected(connection)
    made.application_checker()
    assert connection not in made.connections


def test_the_timeout_sweep_skips_http_requests_without_a_timeout(reactor, loop):
    made = server()
    socket, request = connect(made, loop), HttpConnection()
    made.protocol_connected(request)
    made.timeout_checker()
    assert (socket.timeout_checks, request.timeout_checks) == (1, 0)
    assert reactor.later == [(TIMEOUT_SWEEP_S, made.timeout_checker)]
    timed = server(http_timeout=30)
    request = HttpConnection()
    timed.protocol_connected(request)
    timed.timeout_checker()
    assert request.timeout_checks == 1


class Socket:
    """What daphne's WebSocketProtocol.onMessage touches (the limits wrap it)."""

    muted = False

    def __init__(self) -> None:
        self.application_queue: asyncio.Queue = asyncio.Queue()
        self.last_ping = 0.0

    def onMessage(self, payload, isBinary):  # daphne's: queue the frame for the application
        self.last_ping = time.time()
        self.application_queue.put_nowait({"type": "websocket.receive", "bytes": payload})

    def handle_reply(self, message):
        pass


def test_the_frame_shortcut_takes_a_frame_only_when_nothing_is_queued_ahead_of_it():
    class Limited(Socket):
        pass

    daphne_limits._bounded_websockets(Limited)
    sock = Limited()
    sock.onMessage(b"before", True)  # no shortcut installed: queued, as daphne does
    offered: list[bytes] = []
    daphne_server.install_frame_shortcut(
        sock, lambda payload, binary: offered.append(payload) or payload == b"beat"
    )
    sock.onMessage(b"beat", True)  # a frame is queued ahead: not offered, queued in order
    assert offered == [] and sock.application_queue.qsize() == 2
    while sock.application_queue.qsize():
        sock.application_queue.get_nowait()
    sock.last_ping = 0.0
    sock.onMessage(b"beat", True)  # taken by the shortcut: never queued, the socket alive
    assert offered == [b"beat"] and sock.application_queue.qsize() == 0
    assert sock.last_ping > 0
    sock.onMessage(b"other", True)  # refused by the shortcut: queued
    assert offered == [b"beat", b"other"]
    assert sock.application_queue.get_nowait()["bytes"] == b"other"


def test_websocket_applications_are_offered_the_frame_shortcut(loop):
    made = server()
    seen: list[dict] = []

    async def application(scope, receive, send):
        seen.append(scope)

    made.application = application
    connection = Connection()
    made.protocol_connected(connection)
    asyncio.set_event_loop(loop)
    made.create_application(connection, {"type": "websocket", "path": "/ws/agents/x/"})
    loop.run_until_complete(asyncio.sleep(0))
    handler = lambda payload, binary: True  # noqa: E731
    seen[0][FRAME_SHORTCUT](handler)
    assert connection.frame_shortcut is handler
    http = Connection()
    made.protocol_connected(http)
    made.create_application(http, {"type": "http", "path": "/"})
    loop.run_until_complete(asyncio.sleep(0))
    assert FRAME_SHORTCUT not in seen[1]
