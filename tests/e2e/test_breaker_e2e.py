"""The circuit breaker over real sockets (issue 15): a real `runagent` that refuses every
packet (tests/support/gated_runagent.py's ``refuse`` gate) trips its breaker, is skipped
while it is open, and a half-open probe that succeeds closes it — seen in GET /fleet and
/metrics of a real `serve`."""

from __future__ import annotations

import re

import httpx
import pytest

from fleet.models import TaskExecution
from tests.support.keys import cli_agent_key, cli_tenant_key
from tests.support.processes import Processes, fleet_serve, start_agent
from tests.support.server_api import start, upload, wait_terminal
from tests.support.waiting import wait_until
from tests.support.workloads import agent_package

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

FAILURES = 3
COOLOFF_S = 8


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


def test_a_refusing_agent_trips_is_skipped_and_a_probe_closes_its_breaker(procs, tmp_path):
    key, akey = cli_tenant_key(procs), cli_agent_key(procs)
    server = fleet_serve(
        procs,
        CLOACINA_BREAKER_FAILURES=str(FAILURES),
        CLOACINA_BREAKER_COOLOFF_S=str(COOLOFF_S),
    )
    upload(server, key, agent_package(task="quick"))
    gates = tmp_path / "gates"
    gates.mkdir()
    (gates / "refuse").touch()
    # The refusing agent has the most free slots: selection (most free first) tries it first.
    refuser = start_agent(procs, server, akey, "refuser", slots=4, gates=gates)
    start_agent(procs, server, akey, "steady", slots=1)

    def breakers() -> dict[str, str]:
        body = httpx.get(
            server.api("/fleet"), headers={"Authorization": f"Bearer {key}"}, timeout=10
        ).json()
        return {a["name"]: a["breaker"] for a in body["agents"]}

    assert breakers() == {"refuser": "closed", "steady": "closed"}
    first = start(server, key, "agentwf", {})
    wait_until(
        lambda: breakers()["refuser"] == "open", timeout=30, what="the refuser's breaker to open",
        logs=refuser.tail,
    )  # fmt: skip
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert re.search(r'^cloacina_fleet_breaker_trips_total\{cause="refusal"\} 1\.0$', metrics, re.M)
    assert 'cloacina_fleet_agents_breaker{state="open",tenant="acme"} 1.0' in metrics
    assert 'cloacina_fleet_agents_breaker{state="closed",tenant="acme"} 1.0' in metrics

    # While open it is skipped: the refused task ran on the other agent.
    body = wait_terminal(server, key, first, timeout=30)
    assert body["status"] == "Completed", body
    assert body["tasks"][0]["agent"] == "steady"
    # Refused exactly FAILURES times: after the trip it was not offered the task again.
    assert TaskExecution.objects.get(workflow_execution_id=first).refusals == FAILURES

    # The agent recovers; after the cool-off one probe is placed on it, and its success
    # closes the breaker.
    (gates / "refuse").unlink()
    wait_until(
        lambda: breakers()["refuser"] == "half_open", timeout=COOLOFF_S + 20,
        what="the cool-off to pass",
    )  # fmt: skip
    probe = start(server, key, "agentwf", {})
    body = wait_terminal(server, key, probe, timeout=30)
    assert body["status"] == "Completed", body
    assert body["tasks"][0]["agent"] == "refuser"
    assert breakers() == {"refuser": "closed", "steady": "closed"}
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'cloacina_fleet_agents_breaker{state="closed",tenant="acme"} 2.0' in metrics
