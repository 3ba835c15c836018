"""Helpers for the control-plane end-to-end tests: a real `serve --actuator process` and the
real `runagent` children it starts, against the test database."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.e2e_support import Processes, ServeHandle

SLOW_TASKS = """
import time

def slow(ctx):
    time.sleep(float(ctx.get("sleep_s", 2.0)))
    return {"slept": True}
"""
LEADER_LINE = re.compile(r"fleet control: server (\S+) is now the leader")


def control_env(procs: Processes, **extra: str) -> dict:
    """Short intervals so a control-plane test takes seconds, not minutes."""
    settings = {
        "CLOACINA_DEFAULT_EXECUTOR": "fleet",
        "CLOACINA_FLEET_ACTUATOR": "process",
        "CLOACINA_AUTOSCALE": "false",
        "CLOACINA_AUTOSCALE_INTERVAL_S": "0.3",
        "CLOACINA_AUTOSCALE_COOLDOWN_S": "0.5",
        "CLOACINA_AGENT_HEARTBEAT_INTERVAL_S": "0.5",
        "CLOACINA_AGENT_LIVENESS_MISSES": "3",
        "CLOACINA_AGENT_MAX_CONCURRENCY": "2",
        "CLOACINA_AGENT_DRAIN_TIMEOUT_S": "30",
    }
    settings.update(extra)
    return procs.env(**settings)


def wait_until(
    predicate: Callable[[], object],
    what: str,
    timeout: float = 30.0,
    logs: Callable[[], str] | None = None,
    interval: float = 0.1,
):
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` and the logs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{logs() if logs else ''}")


def agent_logs(home: Path, lines: int = 15) -> str:
    out = []
    for path in sorted((home / "agents").glob("*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {path.name}\n" + "\n".join(tail))
    return "\n".join(out)


def diagnostics(procs: Processes, *serves: ServeHandle) -> Callable[[], str]:
    def render() -> str:
        parts = [f"=== {s.process.name}\n{s.process.tail(40)}" for s in serves]
        return "\n".join(parts) + "\n" + agent_logs(procs.home)

    return render


def live_agents(tenant) -> list:
    from agents.models import Agent

    return list(Agent.objects.filter(tenant=tenant, state="live").order_by("name"))


def seq_of(name: str) -> int:
    """proc-<server pid>-<n> → n (the process actuator's start order)."""
    return int(name.rsplit("-", 1)[1])


def pid_of(name: str) -> int:
    return int(name.split("-")[1])


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
