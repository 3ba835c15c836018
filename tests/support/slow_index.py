"""A package index that streams a large wheel slowly, to catch pip mid-download (the
download cap, a killed build, a server that dies while its pip runs)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MiB = 1024 * 1024


BIG_WHEEL = "bigext-1.0-py3-none-any.whl"


BIG_WHEEL_BYTES = 64 * MiB


CHUNK = 64 * 1024


CHUNK_PAUSE_S = 0.01  # ~6 MB/s: the whole wheel would take ~10 s


class SlowIndex(ThreadingHTTPServer):
    """Serves ``bigext`` 1.0: ``payload`` (default: 64 MiB of zeros, not a valid wheel)
    in chunks with a pause after each; counts what it sent over all downloads."""

    daemon_threads = True
    sent = 0
    aborted = False
    payload: bytes | None = None
    pause_s = CHUNK_PAUSE_S

    def size(self) -> int:
        return BIG_WHEEL_BYTES if self.payload is None else len(self.payload)


class SlowIndexHandler(BaseHTTPRequestHandler):
    server: SlowIndex

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/simple/bigext":
            page = f'<html><body><a href="/files/{BIG_WHEEL}">{BIG_WHEEL}</a></body></html>'
            self._send(page.encode(), "text/html")
        elif self.path == f"/files/{BIG_WHEEL}":
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(self.server.size()))
            self.end_headers()
            self._stream()
        else:
            self.send_error(404)

    def _send(self, body: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _stream(self) -> None:
        server = self.server
        data = server.payload
        size = server.size()
        try:
            for offset in range(0, size, CHUNK):
                chunk = b"\0" * CHUNK if data is None else data[offset : offset + CHUNK]
                self.wfile.write(chunk[: size - offset])
                server.sent += len(chunk)
                time.sleep(server.pause_s)
        except (BrokenPipeError, ConnectionResetError):
            server.aborted = True


def start_slow_index() -> SlowIndex:
    server = SlowIndex(("127.0.0.1", 0), SlowIndexHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def slow_index_env(server: SlowIndex) -> dict[str, str]:
    """pip's environment for ``server`` as the only index (no operator config)."""
    return {
        "PIP_CONFIG_FILE": "/dev/null",
        "PIP_INDEX_URL": f"http://127.0.0.1:{server.server_address[1]}/simple/",
    }
