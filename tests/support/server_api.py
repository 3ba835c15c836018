"""Talking to a running `serve` over HTTP, as a client with a tenant's key would."""

from __future__ import annotations

import re
import time

import httpx

from tests.support.processes import ServeHandle

TERMINAL = {"Completed", "Failed", "Cancelled"}


def upload(server: ServeHandle, key: str, data: bytes) -> dict:
    """POST a package archive; assert 201."""
    response = httpx.post(
        server.api("/packages"),
        files={"file": ("pkg.tar.gz", data)},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert response.status_code == 201, response.text
    return response.json()


def start(server: ServeHandle, key: str, workflow: str, context: dict) -> str:
    """Start an execution; return its id."""
    response = httpx.post(
        server.api(f"/workflows/{workflow}/executions"),
        json={"context": context},
        headers={"Authorization": f"Bearer {key}"},
        timeout=10,
    )
    assert response.status_code == 201, response.text
    return response.json()["id"]


def execution(server: ServeHandle, key: str, execution_id: str) -> dict:
    """GET /executions/{id}'s body."""
    return httpx.get(
        server.api(f"/executions/{execution_id}"),
        headers={"Authorization": f"Bearer {key}"},
        timeout=10,
    ).json()


def wait_terminal(server: ServeHandle, key: str, execution_id: str, timeout: float = 30.0) -> dict:
    """Poll GET /executions/{id} until it is Completed, Failed or Cancelled; return the body."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = execution(server, key, execution_id)
        if body["status"] in TERMINAL:
            return body
        time.sleep(0.05)
    raise AssertionError(f"execution {execution_id} not finished after {timeout}s: {body}")


def metric(server: ServeHandle, name: str) -> float:
    """One sample of the server's /metrics."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


class Api:
    """The REST API of one running server, as a tenant key sees it."""

    def __init__(self, serve: ServeHandle, key: str) -> None:
        self.serve = serve
        self.headers = {"Authorization": f"Bearer {key}"}

    def post(self, path: str, json: dict | None = None) -> httpx.Response:
        return httpx.post(self.serve.api(path), headers=self.headers, json=json, timeout=10)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.serve.api(path), headers=self.headers, timeout=10)

    def start(self, workflow: str, context: dict) -> str:
        res = self.post(f"/workflows/{workflow}/executions", {"context": context})
        assert res.status_code == 201, res.text
        return res.json()["id"]
