"""Task logs end to end: real `serve` (the in-process executor) and real `runagent`
processes; a task that prints and logs, and its log read back over REST."""

from __future__ import annotations

import httpx
import pytest

from artifacts.store.testing import build_archive, manifest_toml
from tests.support.keys import cli_agent_key, cli_tenant_key
from tests.support.processes import Processes, ServeHandle, fleet_serve, start_agent
from tests.support.server_api import start, upload, wait_terminal
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

TASKS = [
    {"id": "talk", "function": "chatty.steps:talk"},
    {"id": "ticks", "function": "chatty.steps:ticks", "dependencies": ["talk"], "timeout_s": 60},
    {"id": "fail", "function": "chatty.steps:fail", "dependencies": ["ticks"], "retries": 1},
]
SOURCE = """
import logging, os, sys, time

log = logging.getLogger("chatty")


def talk(context):
    print("hello from talk")
    print("a warning on stderr", file=sys.stderr)
    log.info("rows=%d", 3)
    return {"talked": True}


def ticks(context):
    # Prints for a while, and waits for the test to have seen the live tail.
    for i in range(context.get("ticks", 3)):
        print(f"tick {i}")
        time.sleep(0.05)
    deadline = time.monotonic() + 30
    while context.get("gate") and not os.path.exists(context["gate"]):
        assert time.monotonic() < deadline, "the test never opened the gate"
        time.sleep(0.05)
    print("ticks done")
    sys.stdout.write("x" * context.get("flood", 0))
    return {}


def fail(context):
    print(f"attempt with pid {os.getpid()}")
    raise RuntimeError("fails on every attempt")
"""


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


def package() -> bytes:
    return build_archive(
        {
            "cloacina.toml": manifest_toml(TASKS, name="chatty", workflow="chatty"),
            "workflow/chatty/__init__.py": "",
            "workflow/chatty/steps.py": SOURCE,
        }
    )


def logs(server: ServeHandle, key: str, execution_id: str, task: str, query: str = ""):
    return httpx.get(
        server.api(f"/executions/{execution_id}/tasks/{task}/logs{query}"),
        headers={"Authorization": f"Bearer {key}"},
        timeout=10,
    )


def check_logs(server: ServeHandle, key: str, execution_id: str) -> None:
    """What every executor must have captured for the chatty workflow."""
    talk = logs(server, key, execution_id, "talk")
    assert talk.status_code == 200 and talk.headers["content-type"].startswith("text/plain")
    lines = talk.text.splitlines()
    assert lines[:2] == ["hello from talk", "a warning on stderr"]
    assert lines[2].endswith("INFO chatty: rows=3")
    assert talk.headers["x-cloacina-log-finished"] == "true"
    # Both attempts of the failing task, each with its own output.
    second = logs(server, key, execution_id, "fail")
    first = logs(server, key, execution_id, "fail", "?attempt=1")
    assert second.headers["x-cloacina-attempt"] == "2"
    assert first.text.startswith("attempt with pid ") and second.text.startswith("attempt with")
    assert logs(server, key, execution_id, "fail", "?attempt=3").status_code == 404
    assert logs(server, key, execution_id, "fail", "?attempt=zero").status_code == 422


def tail_while_running(server: ServeHandle, key: str, execution_id: str, gate) -> None:
    """While ``ticks`` waits at its gate, its live log already shows what it printed."""
    live = wait_until(
        lambda: (
            (r := logs(server, key, execution_id, "ticks")).status_code == 200
            and "tick 2" in r.text
            and r
        ),
        timeout=30,
        what="the live tail of ticks",
        logs=lambda: server.process.tail(40),
    )
    assert live.headers["x-cloacina-log-finished"] == "false"
    assert live.text.startswith("tick 0\ntick 1\ntick 2\n")
    gate.write_text("open")


def test_the_in_process_executor_captures_and_serves_task_logs(procs, tmp_path):
    key = cli_tenant_key(procs)
    server = procs.serve()
    upload(server, key, package())
    gate = tmp_path / "gate"
    execution_id = start(server, key, "chatty", {"gate": str(gate)})
    tail_while_running(server, key, execution_id, gate)
    body = wait_terminal(server, key, execution_id, timeout=60)
    assert body["status"] == "Failed"
    check_logs(server, key, execution_id)
    done = logs(server, key, execution_id, "ticks")
    assert done.text.endswith("ticks done\n")
    assert done.headers["x-cloacina-log-finished"] == "true"


def test_runagent_ships_task_logs_live_and_with_the_outcome(procs, tmp_path):
    key = cli_tenant_key(procs)
    server = fleet_serve(procs)
    start_agent(procs, server, cli_agent_key(procs), "logger", slots=2)
    upload(server, key, package())
    gate = tmp_path / "gate"
    execution_id = start(server, key, "chatty", {"gate": str(gate)})
    tail_while_running(server, key, execution_id, gate)
    assert wait_terminal(server, key, execution_id, timeout=60)["status"] == "Failed"
    check_logs(server, key, execution_id)


def test_a_log_too_large_for_a_frame_goes_over_rest_and_is_truncation_marked(procs):
    key = cli_tenant_key(procs)
    # The server keeps logs up to its own CLOACINA_TASK_LOG_BYTES whatever an agent sends
    # (test_task_logs.py): this operator raised it for server and agents alike.
    server = fleet_serve(procs, CLOACINA_TASK_LOG_BYTES=str(2 * 1024 * 1024))
    # The agent keeps 2 MiB: its 1.5 MiB log does not fit a 1 MiB socket frame.
    agent_env = procs.env(CLOACINA_TASK_LOG_BYTES=str(2 * 1024 * 1024))
    big = start_agent(procs, server, cli_agent_key(procs), "big", env=agent_env)
    upload(server, key, package())
    flood = 1536 * 1024
    execution_id = start(server, key, "chatty", {"ticks": 1, "flood": flood})
    assert wait_terminal(server, key, execution_id, timeout=60)["status"] == "Failed"
    ticks = logs(server, key, execution_id, "ticks")
    assert ticks.headers["x-cloacina-log-bytes"] == str(len("tick 0\nticks done\n") + flood)
    assert ticks.headers["x-cloacina-log-truncated-bytes"] == "0"
    assert ticks.text.endswith("x" * 1000) and len(ticks.text) == flood + 18
    # And an agent with a small ring marks what it dropped.
    big.stop()
    small_env = procs.env(CLOACINA_TASK_LOG_BYTES="4096")
    start_agent(procs, server, cli_agent_key(procs), "small", env=small_env)
    second = start(server, key, "chatty", {"ticks": 1, "flood": 10_000})
    assert wait_terminal(server, key, second, timeout=60)["status"] == "Failed"
    small = logs(server, key, second, "ticks")
    dropped = len("tick 0\nticks done\n") + 10_000 - 4096
    assert small.text == f"[… {dropped} bytes truncated …]\n" + "x" * 4096
