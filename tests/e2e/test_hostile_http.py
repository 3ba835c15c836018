"""Hostile HTTP against a real `serve`: request bodies past the largest legitimate one.

The server runs with CLOACINA_MAX_PACKAGE_BYTES=4 MiB and CLOACINA_MAX_CONTEXT_BYTES=1 MiB,
so its cap is 5 MiB (the larger of the two plus 1 MiB).  A body over it is answered
413 by daphne as it streams in — before Django, so before authentication — whether
its length is declared or it comes chunked; the rest of it is thrown away, so the
server's memory stays flat; bodies within the cap still reach the API.
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import pytest

from artifacts.store.testing import example_archive
from tests.support.hostile import Served
from tests.support.keys import tenant_keys
from tests.support.processes import Processes

pytestmark = pytest.mark.e2e

MB = 1024 * 1024
CAP = 4 * MB + 1 * MB  # max(package, context) + the 1 MiB margin
CHUNK = 64 * 1024
HUGE = 300 * MB  # what the hostile client streams in all


@pytest.fixture(name="served")
def small_cap_server(transactional_db, tmp_path):
    keys = tenant_keys()
    env = {"CLOACINA_MAX_PACKAGE_BYTES": str(4 * MB), "CLOACINA_MAX_CONTEXT_BYTES": str(MB)}
    with Processes(tmp_path, **env) as procs:
        yield Served(procs, procs.serve(), keys)


def _connect(served: Served) -> socket.socket:
    url = urlsplit(served.server.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=15)
    return sock


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length (what the 413 carries)."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        assert more, f"connection closed before a response; got {data!r}"
        data += more
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        more = sock.recv(65536)
        if not more:
            break
        body += more
    return status, headers, body


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def test_a_chunked_body_past_the_cap_is_a_413_as_it_streams_and_memory_stays_flat(served):
    before = served.rss_mb()
    sock = _connect(served)
    # No Authorization: the refusal must come before the application looks at credentials.
    sock.sendall(
        b"POST /api/v1/packages HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    payload = _chunk(b"x" * CHUNK)
    sent = 0
    while sent <= CAP + MB:  # past the cap, and the body is not finished (no last chunk)
        sock.sendall(payload)
        sent += CHUNK
    status, headers, body = _read_response(sock)
    assert status == 413, body[:300]
    assert headers["content-type"] == "application/json"
    assert f"over the {CAP}-byte limit" in json.loads(body)["detail"]
    # Keep streaming: the server reads and discards it, holding nothing.
    started = time.monotonic()
    try:
        while sent < HUGE:
            sock.sendall(payload)
            sent += CHUNK
    except OSError:  # the server closed the connection after its linger: also fine
        pass
    elapsed = time.monotonic() - started
    sock.close()
    after = served.rss_mb()
    print(
        f"\nserver memory: {before:.0f} MB before, {after:.0f} MB after a "
        f"{sent / MB:.0f} MB chunked body (413 after {CAP / MB:.0f} MB; "
        f"rest streamed in {elapsed:.1f} s)"
    )
    assert after - before < 30, f"server grew {after - before:.0f} MB"
    served.assert_still_serving()


def test_a_declared_length_past_the_cap_is_refused_before_its_body_is_sent(served):
    sock = _connect(served)
    sock.sendall(
        b"POST /api/v1/packages HTTP/1.1\r\nHost: localhost\r\n"
        + f"Content-Length: {CAP + 1}\r\n".encode()
        + b"Expect: 100-continue\r\nContent-Type: application/octet-stream\r\n\r\n"
    )
    # Not a "100 Continue" inviting the body: the refusal, with no body sent at all.
    status, _, body = _read_response(sock)
    sock.close()
    assert status == 413, body[:300]
    assert f"over the {CAP}-byte limit" in json.loads(body)["detail"]
    served.assert_still_serving()


def test_bodies_within_the_cap_still_reach_the_api(served):
    uploaded = served.post("/packages", files={"file": ("etl.tar.gz", example_archive())})
    assert uploaded.status_code == 201, uploaded.text

    def chunks():
        yield b'{"context": {"rows": "'
        yield b"y" * (MB // 2)
        yield b'"}}'

    started = served.post(
        "/workflows/etl/executions",
        content=chunks(),  # a generator: httpx sends it chunked
        headers={"Content-Type": "application/json"},
    )
    assert started.status_code == 201, started.text[:300]
    # Just over the cap with a declared length, authenticated: still refused.
    refused = served.post(
        "/workflows/etl/executions",
        content=b"{" + b" " * CAP + b"}",
        headers={"Content-Type": "application/json"},
    )
    assert refused.status_code == 413
    assert "CLOACINA_MAX_PACKAGE_BYTES" in refused.json()["detail"]


# -- the ASGI layer (for servers other than daphne) -------------------------------------


async def _call(limit: int, headers: list, bodies: list[bytes]) -> tuple[list, list]:
    from cloacina_site.asgi import BodyLimit

    seen: list[bytes] = []
    sent: list[dict] = []
    messages = [
        {"type": "http.request", "body": b, "more_body": i < len(bodies) - 1}
        for i, b in enumerate(bodies)
    ]

    async def app(scope, receive, send):
        while True:  # like Django's read_body: stop at the last chunk or a disconnect
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            seen.append(message["body"])
            if not message["more_body"]:
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    await BodyLimit(app, limit)({"type": "http", "headers": headers}, receive, send)
    return seen, sent


@pytest.mark.asyncio
async def test_the_asgi_layer_refuses_a_declared_or_streamed_body_past_its_limit():
    seen, sent = await _call(10, [(b"content-length", b"11")], [b"x" * 11])
    assert seen == [] and sent[0]["status"] == 413
    seen, sent = await _call(10, [], [b"x" * 6, b"x" * 6, b"x" * 6])
    assert seen == [b"x" * 6] and sent[0]["status"] == 413
    assert "over the 10-byte limit" in json.loads(sent[1]["body"])["detail"]
    seen, sent = await _call(10, [], [b"x" * 5, b"x" * 5])
    assert seen == [b"x" * 5, b"x" * 5] and sent[0]["status"] == 200
