"""Idle HTTP keep-alive connections are closed by `serve`, WebSockets are not.

Twisted keeps an idle HTTP/1.1 connection twelve hours; every agent's REST connection sits
idle once its delivery socket is up, so at thousands of agents they were a large share of
the server's memory.  `serve` closes one idle for CLOACINA_HTTP_KEEPALIVE_S (1 s here);
a WebSocket upgraded from an HTTP request keeps its connection however long it lives.
"""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from websockets.sync.client import connect

from agents.protocol import frames, wire
from agents.protocol.triples import host_triple
from tests.support.keys import tenant_keys
from tests.support.processes import Processes
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e

KEEPALIVE_S = 1.0


@pytest.fixture(name="server")
def short_keepalive_server(transactional_db, tmp_path):
    keys = tenant_keys()
    with Processes(tmp_path, CLOACINA_HTTP_KEEPALIVE_S=str(KEEPALIVE_S)) as procs:
        yield procs.serve(), keys


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(0.05)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False


def test_an_idle_keepalive_connection_is_closed_and_a_websocket_is_not(server):
    serve, keys = server
    url = urlsplit(serve.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=15)
    sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: {url.hostname}\r\n\r\n".encode())
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 200"), answer
    assert b"connection: close" not in answer.lower()  # kept alive, then timed out
    idle_from = time.monotonic()
    wait_until(lambda: _closed_by_peer(sock), timeout=KEEPALIVE_S + 15, what="idle close")
    assert time.monotonic() - idle_from >= KEEPALIVE_S * 0.9
    sock.close()

    registered = httpx.post(
        serve.api("/agents/register"),
        json={"name": "kept", "target_triple": host_triple(), "protocol_version": 1},
        headers={"Authorization": f"Bearer {keys['agent']}"},
        timeout=30,
    ).json()
    ws_url = f"ws://{url.hostname}:{url.port}{registered['ws_path']}"
    with connect(ws_url, additional_headers={"Authorization": f"Bearer {keys['agent']}"}) as ws:
        ws.send(wire.encode(frames.hello([]), "json"))
        opened = time.monotonic()
        # Three keep-alive timeouts on an open socket; a pong each round says it still is.
        while time.monotonic() - opened < 3 * KEEPALIVE_S:
            assert ws.ping().wait(10), "the WebSocket stopped answering"
            time.sleep(KEEPALIVE_S / 2)
        assert ws.ping().wait(10)
