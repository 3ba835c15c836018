"""Helpers for the agent's end-to-end tests: a fleet `serve`, real `runagent`s, a small package.

Heartbeats are short (0.5 s) so reconnects, evictions and drains happen within
a second or two.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from artifacts.testing import build_archive, manifest_toml
from tests import fleet_e2e_support
from tests.e2e_support import ManagedProcess, Processes, ServeHandle
from tests.e2e_support import wait_until as wait_until  # re-exported for the agent tests

SOCKET_OPEN = re.compile(r"delivery socket open")

STEPS_SOURCE = '''
import os
import time
from pathlib import Path


def slow(context):
    """Appends this run's pid to context["runs"], marks context["started"], sleeps."""
    with open(context["runs"], "a") as fh:
        fh.write(f"{os.getpid()}\\n")
    Path(context["started"]).write_text("started")
    time.sleep(float(context.get("sleep_s", 0)))
    return {"slept_s": context.get("sleep_s", 0)}


def quick(context):
    return {"n": context.get("n", 0) + 1}
'''


def agent_package(name: str = "agentpkg", workflow: str = "agentwf", task: str = "slow") -> bytes:
    """A one-task python package (``slow`` or ``quick`` from :data:`STEPS_SOURCE`)."""
    tasks = [{"id": task, "function": f"agentsteps.steps:{task}", "timeout_s": 60}]
    return build_archive(
        {
            "cloacina.toml": manifest_toml(tasks, name=name, workflow=workflow),
            "workflow/agentsteps/__init__.py": "",
            "workflow/agentsteps/steps.py": STEPS_SOURCE,
        }
    )


def slow_context(tmp_path: Path, sleep_s: float, label: str = "run") -> dict:
    return {
        "runs": str(tmp_path / f"{label}-runs.txt"),
        "started": str(tmp_path / f"{label}-started"),
        "sleep_s": sleep_s,
    }


def runs_of(context: dict) -> int:
    """How many times the slow task actually started (one line per run)."""
    path = Path(context["runs"])
    return len(path.read_text().splitlines()) if path.exists() else 0


def fleet_serve(procs: Processes, port: int | None = None, name: str | None = None) -> ServeHandle:
    """The fleet helpers' server, with a short redelivery age for the agent tests."""
    return fleet_e2e_support.fleet_serve(procs, port, name, CLOACINA_OUTBOX_REDELIVER_S="2")


mint_agent_key = fleet_e2e_support.agent_key


def start_agent(
    procs: Processes,
    url: str,
    key: str,
    name: str,
    *flags: str,
    env: dict | None = None,
    wait: bool = True,
) -> ManagedProcess:
    """``runagent`` with its own cache dir; waits for its delivery socket unless ``wait=False``."""
    cache = procs.tmp_path / f"cache-{name}"
    args = [
        "runagent",
        "--server",
        url,
        "--api-key",
        key,
        "--name",
        name,
        "--cache-dir",
        str(cache),
    ]
    process = procs.start([*args, *flags], name=f"agent-{name}", env=env)
    if wait:
        process.wait_for_output(SOCKET_OPEN, 60)
    return process


def wait_exit(process: ManagedProcess, timeout: float = 30.0) -> int:
    """The process's exit code once it has exited on its own (fails with its log otherwise)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = process.poll()
        if code is not None:
            return code
        time.sleep(0.05)
    raise AssertionError(f"{process.name} still running after {timeout}s:\n{process.tail()}")
