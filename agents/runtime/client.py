"""The agent's REST client (httpx): register, heartbeat, results, deregister, artifacts.

Every failure is sorted into what the agent must do about it: retry later
(:class:`ServerUnavailable`), stop (:class:`AuthRejected`, :class:`ProtocolMismatch`,
:class:`TLSFailure` at registration), wait and register again (:class:`RateLimited`),
re-register (:class:`UnknownAgent`) or give up on that one request (:class:`RequestRejected`).
The API key only ever travels in the Authorization header; it is in no message here.
"""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from agents.runtime.tls import (
    AgentTLS,
    client_context,
    explain,
    handshake_refusal,
    ssl_error_in,
)

log = logging.getLogger(__name__)

API_PREFIX = "/api/v1"
CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 30.0
# A proxy whose backend is gone, or a server shutting down: another replica may answer.
UNAVAILABLE_STATUSES = (502, 503, 504)
# Artifacts can be tens of megabytes; allow for a slow link.
ARTIFACT_TIMEOUT_S = 300.0


class ClientError(Exception):
    """Base of the REST client's errors; ``status`` is the HTTP status (0: no answer)."""

    status: int = 0

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class ServerUnavailable(ClientError):
    """No answer, a timeout or a 5xx: try again later."""


class TLSFailure(ServerUnavailable):
    """The TLS handshake failed (untrusted server, refused client certificate, …).

    A ServerUnavailable, so a call in the middle of work keeps retrying as it would
    for any outage; at registration — the first contact — the agent stops instead,
    because a certificate or CA mismatch does not go away by waiting.
    """


class AuthRejected(ClientError):
    """401/403: the key is bad, revoked or of the wrong role. Retrying cannot help."""


class ProtocolMismatch(ClientError):
    """409 at registration: the server speaks another protocol version or wire format."""


class RateLimited(ClientError):
    """429 at registration: the key's registration rate or the tenant's cap of agents is
    reached for now; wait (``retry_after_s`` from Retry-After when the server sent one)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message, 429)
        self.retry_after_s = retry_after_s


def retry_after_s(response: httpx.Response) -> float | None:
    """The Retry-After header in seconds; None when absent or not delta-seconds (an
    HTTP-date is not worth trusting across two clocks: the agent's own backoff applies)."""
    raw = response.headers.get("Retry-After", "").strip()
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if value >= 0 else None


class UnknownAgent(ClientError):
    """404 for our agent id: the server declared us dead (or forgot us)."""


class RequestRejected(ClientError):
    """Any other 4xx: this request is wrong and resending it unchanged will not help."""


@dataclass(frozen=True)
class Registration:
    agent_id: str
    name: str
    heartbeat_interval_s: float
    liveness_misses: int
    wire_format: str
    ws_path: str
    # The server answers ``result`` frames on the delivery socket (older servers: REST only).
    result_frames: bool = False
    # The server takes ``log`` frames (live output of running tasks) on the socket.
    log_frames: bool = False
    # The server takes ``batch`` frames (several ``received``/``result`` frames in one).
    batch_frames: bool = False

    @classmethod
    def from_answer(cls, data: dict[str, Any], body: dict[str, Any]) -> Registration:
        """The server's answer to the registration ``body`` (REST 201 or a ``registered``
        frame); what an older server leaves out has its old default."""
        agent_id = str(data["agent_id"])
        return cls(
            agent_id=agent_id,
            name=data.get("name", body.get("name", "")),
            heartbeat_interval_s=float(data.get("heartbeat_interval_s", 15.0)),
            liveness_misses=int(data.get("liveness_misses", 3)),
            wire_format=data.get("wire_format", body.get("wire_format", "json")),
            ws_path=data.get("ws_path") or f"/ws/agents/{agent_id}/",
            result_frames=data.get("result_frames") is True,
            log_frames=data.get("log_frames") is True,
            batch_frames=data.get("batch_frames") is True,
        )


def normalise_server_url(url: str) -> str:
    """``http(s)://host[:port][/prefix]`` without a trailing slash; ValueError if unusable."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"server URL must look like http://host:port, got {url!r}")
    return urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))


def server_list(raw: str | Sequence[str]) -> tuple[str, ...]:
    """Every server URL of ``raw`` (a string, or strings, each possibly comma-separated),
    normalised, duplicates dropped, in the order given; ValueError if none or one is
    unusable, or if they mix http:// and https:// (one TLS setting serves them all)."""
    items = [raw] if isinstance(raw, str) else list(raw)
    urls: list[str] = []
    for item in items:
        for part in item.split(","):
            if part.strip():
                url = normalise_server_url(part)
                if url not in urls:
                    urls.append(url)
    if not urls:
        raise ValueError("no server URL given")
    if len({urlsplit(url).scheme for url in urls}) > 1:
        raise ValueError(f"server URLs must all be http:// or all https://, got {', '.join(urls)}")
    return tuple(urls)


def websocket_url(server_url: str, ws_path: str) -> str:
    """The delivery socket's URL: http→ws, https→wss, the server's path prefix kept."""
    parts = urlsplit(server_url)
    scheme = "wss" if parts.scheme == "https" else "ws"
    return urlunsplit((scheme, parts.netloc, parts.path + ws_path, "", ""))


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except (ValueError, json.JSONDecodeError):
        return response.text[:300] or response.reason_phrase
    if isinstance(body, dict) and "detail" in body:
        detail = body["detail"]
        return detail if isinstance(detail, str) else json.dumps(detail)[:300]
    return str(body)[:300]


class AgentClient:
    """Async REST calls of one agent process, authenticated with its API key.

    ``server_url`` may name several servers (replicas on one database): the client talks to
    one at a time and moves to the next (:meth:`fail_over`) when a request gets no answer
    or a 502/503/504, so every caller's retry reaches a live replica.  One URL (a load
    balancer) never moves.
    """

    def __init__(
        self,
        server_url: str | Sequence[str],
        api_key: str,
        transport: httpx.AsyncBaseTransport | None = None,
        tls: AgentTLS | None = None,
    ) -> None:
        self.servers = server_list(server_url)
        self._current = 0
        self.tls = tls or AgentTLS()
        # The same context verifies the server for REST and for the wss:// delivery socket.
        self.ssl_context: ssl.SSLContext | None = (
            client_context(self.tls) if self.server_url.startswith("https:") else None
        )
        self._api_key = api_key
        self._transport = transport
        self._client: httpx.AsyncClient | None = None  # made by the first REST call

    @property
    def _http(self) -> httpx.AsyncClient:
        """The HTTP client, made when first needed: an agent that registers on its socket
        may never make a REST call, and making one (headers, URL, the environment's proxy
        settings) was a tenth of a simulated agent's CPU to connect (fleet/bench/swarm.py)."""
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.server_url + API_PREFIX,
                headers={"Authorization": f"Bearer {self._api_key}"},
                timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
                transport=self._transport,
                verify=self.ssl_context or True,
            )
        return self._client

    @property
    def server_url(self) -> str:
        """The server this client talks to now."""
        return self.servers[self._current]

    def fail_over(self, from_url: str) -> str:
        """Move to the server after ``from_url``, unless another caller already moved
        away from it (many callers noticing one outage move once); the server to use."""
        if len(self.servers) > 1 and from_url == self.server_url:
            self._current = (self._current + 1) % len(self.servers)
            if self._client is not None:
                self._client.base_url = httpx.URL(self.server_url + API_PREFIX)
            log.warning("server %s unavailable; switching to %s", from_url, self.server_url)
        return self.server_url

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
        elif self._transport is not None:  # given to a client that was never made
            await self._transport.aclose()

    async def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        used = self.server_url
        try:
            response = await self._http.request(method, path, **kwargs)
        except (httpx.TransportError, OSError) as exc:
            # Connect refused, reset, timeout, … and a TLS alert that arrives after the
            # handshake (a server refusing our client certificate under TLS 1.3), which
            # escapes httpx as a bare ssl.SSLError.
            tls_error = ssl_error_in(exc)
            if tls_error is None and self._maybe_refused(exc):
                tls_error = await handshake_refusal(used, self.ssl_context)
            if tls_error is not None:
                raise TLSFailure(f"{method} {path}: {explain(tls_error, self.tls)}") from None
            self.fail_over(used)
            raise ServerUnavailable(f"{method} {path}: {type(exc).__name__}: {exc}") from None
        if response.status_code >= 500:
            if response.status_code in UNAVAILABLE_STATUSES:  # stopping, or its gateway failed
                self.fail_over(used)
            raise ServerUnavailable(
                f"{method} {path}: server error {response.status_code}: {_detail(response)}",
                response.status_code,
            )
        if response.status_code in (401, 403):
            raise AuthRejected(
                f"the server rejected the API key ({response.status_code}): {_detail(response)}",
                response.status_code,
            )
        return response

    def _maybe_refused(self, exc: BaseException) -> bool:
        """Whether a dropped connection may hide a TLS refusal (see handshake_refusal)."""
        return self.ssl_context is not None and not isinstance(
            exc, (httpx.ConnectError, httpx.TimeoutException, TimeoutError)
        )

    @staticmethod
    def _rejected(response: httpx.Response, what: str) -> RequestRejected:
        return RequestRejected(
            f"{what} rejected ({response.status_code}): {_detail(response)}", response.status_code
        )

    async def register(self, body: dict[str, Any]) -> Registration:
        response = await self._call("POST", "/agents/register", json=body)
        if response.status_code == 409:
            raise ProtocolMismatch(_detail(response), 409)
        if response.status_code == 429:
            raise RateLimited(
                f"registration refused for now (429): {_detail(response)}",
                retry_after_s(response),
            )
        if response.status_code not in (200, 201):
            raise self._rejected(response, "registration")
        return Registration.from_answer(response.json(), body)

    async def heartbeat(self, agent_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """200 → ``{state, drain}``; 404 → :class:`UnknownAgent`."""
        response = await self._call("POST", f"/agents/{agent_id}/heartbeat", json=body)
        if response.status_code == 404:
            raise UnknownAgent(_detail(response), 404)
        if response.status_code != 200:
            raise self._rejected(response, "heartbeat")
        return response.json()

    async def post_result(self, agent_id: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """The status and body of the answer for every 2xx/4xx (5xx and no answer raise)."""
        response = await self._call("POST", f"/agents/{agent_id}/results", json=body)
        try:
            data = response.json()
        except ValueError:
            data = {"detail": response.text[:300]}
        return response.status_code, data if isinstance(data, dict) else {"detail": str(data)}

    async def deregister(self, agent_id: str) -> None:
        response = await self._call("POST", f"/agents/{agent_id}/deregister", json={})
        if response.status_code == 404:
            raise UnknownAgent(_detail(response), 404)
        if response.status_code != 200:
            raise self._rejected(response, "deregistration")

    async def fetch_artifact(self, digest: str) -> bytes:
        """The artifact's bytes; 404 → :class:`RequestRejected` with status 404."""
        response = await self._call(
            "GET",
            f"/artifacts/{digest}",
            timeout=httpx.Timeout(ARTIFACT_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
        )
        if response.status_code != 200:
            raise self._rejected(response, f"artifact {digest}")
        return response.content

    async def fetch_context(self, agent_id: str, task_execution_id: str, assignment: int) -> bytes:
        """A packet's input context sent by reference (``context_ref``), as raw bytes;
        404/413 → :class:`RequestRejected` with that status."""
        response = await self._call(
            "GET",
            f"/agents/{agent_id}/tasks/{task_execution_id}/context",
            params={"assignment": assignment},
            timeout=httpx.Timeout(ARTIFACT_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
        )
        if response.status_code != 200:
            raise self._rejected(response, f"context of task {task_execution_id}")
        return response.content
