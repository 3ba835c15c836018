"""`serve`'s daphne server (cloacina_site/daphne_server.py): its application check visits
only the connections that changed, and does to them what daphne does; its timeout sweep
skips HTTP requests that cannot time out.  Driven with stand-in connections (integration:
importing daphne installs Twisted's asyncio reactor in the process)."""

from __future__ import annotations

import asyncio
import time

import pytest
from daphne.http_protocol import WebRequest

from cloacina_site import daphne_server
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
