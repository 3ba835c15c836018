"""End-to-end helpers for the fleet: a `serve --default-executor fleet` and real `runagent`s.

Heartbeats are short (0.5 s × 3 misses) so an agent killed in a test is evicted
in about two seconds.
"""

from __future__ import annotations

import re

import httpx

from tests.e2e_support import READY_LINE, ManagedProcess, Processes, ServeHandle, wait_for_http
from tests.e2e_support import wait_until as wait_until  # re-exported for the fleet tests

FLEET_ENV = {
    "CLOACINA_DEFAULT_EXECUTOR": "fleet",
    "CLOACINA_AGENT_HEARTBEAT_INTERVAL_S": "0.5",
    "CLOACINA_AGENT_LIVENESS_MISSES": "3",
}
AGENT_READY = re.compile(r"delivery socket open")

SLOW_ONCE_SOURCE = '''
import os
import time
from pathlib import Path


def slow_once(context):
    """The first run (anywhere) leaves a marker and takes long; any later run is quick."""
    marker = Path(context["marker"])
    if not marker.exists():
        marker.write_text(str(os.getpid()))
        time.sleep(float(context.get("sleep_s", 30)))
        return {"who": "first"}
    return {"who": "second"}


def quick(context):
    time.sleep(float(context.get("quick_s", 0)))
    return {"quick": context.get("n", 0)}
'''


def fleet_serve(
    procs: Processes, port: int | None = None, name: str | None = None, **env_overrides: str
) -> ServeHandle:
    """Start `serve` with the fleet executor (on ``port``, else any free one)."""
    env = procs.env(**{**FLEET_ENV, **env_overrides})
    if port is None:
        return procs.serve(env=env)
    process = procs.start(["serve", "--port", str(port)], name=name or f"serve-{port}", env=env)
    url = process.wait_for_output(READY_LINE, 60).group(1)
    wait_for_http(f"{url}/healthz", timeout=10.0, process=process)
    return ServeHandle(process, url)


def agent_key(procs: Processes, tenant: str = "acme") -> str:
    minted = procs.manage("mintkey", "--tenant", tenant, "--role", "agent")
    assert minted.returncode == 0, minted.stderr
    return minted.stdout.strip()


def run_agent(
    procs: Processes, server: ServeHandle | str, key: str, name: str, slots: int = 1,
    wait: bool = True,
) -> ManagedProcess:  # fmt: skip
    url = server if isinstance(server, str) else server.url
    cache = procs.tmp_path / f"cache-{name}"
    process = procs.start(
        [
            "runagent", "--server", url, "--api-key", key, "--name", name,
            "--max-concurrency", str(slots), "--cache-dir", str(cache),
        ],
        name=f"agent-{name}",
    )  # fmt: skip
    if wait:
        process.wait_for_output(AGENT_READY, 60)
    return process


def metric(server: ServeHandle, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def execution(server: ServeHandle, key: str, execution_id: str) -> dict:
    return httpx.get(
        server.api(f"/executions/{execution_id}"),
        headers={"Authorization": f"Bearer {key}"},
        timeout=10,
    ).json()
