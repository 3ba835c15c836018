"""A tiny threaded HTTP server for fakes of external APIs, recording every request."""

from __future__ import annotations

import json
import ssl
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: object = None

    def q(self, name: str) -> str | None:
        values = self.query.get(name)
        return values[-1] if values else None


class HttpError(Exception):
    def __init__(self, status: int, body: object) -> None:
        super().__init__(status)
        self.status = status
        self.body = body


@dataclass
class Response:
    status: int = 200
    body: object = None
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


class FakeHttpServer:
    """Subclasses implement ``route(method, path, query, body) -> Response``."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.requests: list[Recorded] = []
        self.lock = threading.RLock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def _handle(self) -> None:
                parts = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode(errors="replace")
                query = parse_qs(parts.query)
                with fake.lock:
                    fake.requests.append(
                        Recorded(
                            self.command,
                            parts.path,
                            query,
                            {k.lower(): v for k, v in self.headers.items()},
                            body,
                        )
                    )
                    try:
                        response = fake.route(self.command, parts.path, query, body)
                    except HttpError as exc:
                        response = Response(exc.status, exc.body)
                payload = b""
                if response.body is not None:
                    payload = (
                        response.body.encode()
                        if isinstance(response.body, str)
                        else json.dumps(response.body).encode()
                    )
                self.send_response(response.status)
                self.send_header("Content-Type", response.content_type)
                self.send_header("Content-Length", str(len(payload)))
                for name, value in response.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def route(self, method: str, path: str, query: dict, body: object) -> Response:
        raise NotImplementedError

    def start(self) -> FakeHttpServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def calls(self, method: str | None = None, path_contains: str = "") -> list[Recorded]:
        with self.lock:
            return [
                r
                for r in self.requests
                if (method is None or r.method == method) and path_contains in r.path
            ]
