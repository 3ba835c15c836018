"""Stopped is not dead (issue 15), with real `runagent` processes: a SIGTERM drains the
agent and it deregisters — ``stopped``, no eviction — while a kill -9 leaves it
``disconnected`` inside the liveness window and ``dead`` (evicted) after it."""

from __future__ import annotations

import re
import signal

import httpx
import pytest

from fleet.models import Eviction
from tests.support.keys import cli_agent_key, cli_tenant_key
from tests.support.processes import Processes, fleet_serve, start_agent, wait_exit
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

# A liveness window (6 s) long enough to see a killed agent disconnected before it is dead.
HEARTBEAT_S, MISSES = "1", "6"


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


def test_sigterm_stops_an_agent_and_kill_9_makes_it_dead_after_the_window(procs):
    key, akey = cli_tenant_key(procs), cli_agent_key(procs)
    server = fleet_serve(
        procs,
        CLOACINA_AGENT_HEARTBEAT_INTERVAL_S=HEARTBEAT_S,
        CLOACINA_AGENT_LIVENESS_MISSES=MISSES,
    )
    calm = start_agent(procs, server, akey, "calm")
    doomed = start_agent(procs, server, akey, "doomed")

    def fleet() -> dict[str, tuple[str, str]]:
        body = httpx.get(
            server.api("/fleet"), headers={"Authorization": f"Bearer {key}"}, timeout=10
        ).json()
        return {a["name"]: (a["state"], a["phase"]) for a in body["agents"]}

    assert fleet() == {"calm": ("live", "ready"), "doomed": ("live", "ready")}

    calm.signal(signal.SIGTERM)
    assert wait_exit(calm, timeout=30) == 0, calm.tail()
    assert fleet()["calm"] == ("stopped", "stopped")
    assert not Eviction.objects.filter(agent_name="calm").exists()

    doomed.kill_group()  # kill -9: no drain, no deregistration
    wait_until(
        lambda: fleet()["doomed"] == ("live", "disconnected"), timeout=5,
        what="the killed agent shown disconnected inside the liveness window",
    )  # fmt: skip
    wait_until(
        lambda: fleet()["doomed"] == ("dead", "dead"), timeout=30,
        what="the killed agent declared dead after the liveness window",
    )  # fmt: skip
    assert Eviction.objects.filter(agent_name="doomed").exists()
    assert fleet()["calm"] == ("stopped", "stopped")

    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    for pair in (
        ("new", "connecting"), ("connecting", "ready"), ("(ready|draining)", "stopped"),
        ("ready", "disconnected"), ("disconnected", "dead"),
    ):  # fmt: skip
        pattern = (
            rf'^cloacina_fleet_agent_phase_transitions_total\{{from="{pair[0]}",to="{pair[1]}"\}}'
            r" [1-9]"
        )
        assert re.search(pattern, metrics, re.M), pair
    assert re.search(
        r'cloacina_agent_state_changes_total\{from="(live|draining)",to="stopped"\}', metrics
    )
    assert 'cloacina_agent_state_changes_total{from="live",to="dead"}' in metrics
