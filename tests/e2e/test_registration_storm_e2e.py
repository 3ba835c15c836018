"""A registration storm against a real `serve` whose admission rate is tiny: agents started
all at once are refused (429 at registration, on the registering socket or over REST, close
4013 on the socket), wait the turn the
server gave them (with jitter), and all end up registered and connected; the agents already
connected before the storm keep their registrations, and nobody is evicted."""

from __future__ import annotations

import re

import pytest

from agents.models import Agent
from fleet.models import ApiKey, Eviction, Tenant
from tests.support.processes import AGENT_READY, FLEET_ENV, Processes, start_agent
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e

STORM_ENV = {
    **FLEET_ENV,
    # One admission (a registration or a socket open) every 2 s: agents started together
    # are refused and given turns 2 s apart (an agent registering on its socket takes one
    # admission; over REST, its socket follows its registration within the same 2 s).
    "CLOACINA_AGENT_ADMISSIONS_PER_S": "0.5",
    "CLOACINA_AGENT_HEARTBEAT_INTERVAL_S": "1.0",
    "CLOACINA_AGENT_LIVENESS_MISSES": "5",
}
ALREADY_BACK = 2
STORM = 4
# A refused socket ("retry after N s); reconnecting to … in Ws") or a registration refused
# on the socket ("(429): retry after N s: …; retrying in Ws"): the turn given, the wait taken.
WAITED = re.compile(r"retry after (\d+) s(?:\); reconnecting to \S+|: .*; retrying) in ([\d.]+)s")


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path, **STORM_ENV) as procs:
        yield procs


def test_a_storm_of_agents_all_connect_honouring_the_servers_turns(procs):
    tenant = Tenant.objects.create(name="acme")
    key = ApiKey.mint("agent", tenant)[1]
    server = procs.serve()
    back = [start_agent(procs, server, key, f"back-{i}", wait=True) for i in range(ALREADY_BACK)]
    ids_before = dict(Agent.objects.filter(state="live").values_list("name", "id"))
    assert len(ids_before) == ALREADY_BACK

    storm = [start_agent(procs, server, key, f"storm-{i}", wait=False) for i in range(STORM)]
    for agent in storm:
        agent.wait_for_output(AGENT_READY, 120)
    names = [f"back-{i}" for i in range(ALREADY_BACK)] + [f"storm-{i}" for i in range(STORM)]
    wait_until(
        lambda: (
            Agent.objects.filter(name__in=names, state="live").exclude(connected_to="").count()
            == len(names)
        ),
        what="every agent registered and connected",
        timeout=60,
        logs=lambda: "\n".join(p.tail(15) for p in procs.processes),
    )

    logs = [agent.output() for agent in storm]
    refusals = sum(log.count("retry after") + log.count("(429)") for log in logs)
    assert refusals >= STORM, "\n".join(logs)  # each refused at least once, then admitted
    waits = [wait for log in logs for wait in WAITED.findall(log)]
    assert waits, "\n".join(logs)  # refused 4013 / 429 with a turn, and waited for it
    for retry_after, waited in waits:
        assert float(waited) >= float(retry_after), waits  # the turn honoured, jittered up
    for log in logs:
        assert " ERROR " not in log, log
    assert "Exception inside application" not in server.process.output(), server.process.tail(80)
    assert all(agent.poll() is None for agent in back + storm)
    # The agents already back were not disturbed: same registrations, nobody evicted.
    ids_after = dict(
        Agent.objects.filter(name__in=list(ids_before), state="live").values_list("name", "id")
    )
    assert ids_after == ids_before
    assert not Eviction.objects.exists()
    assert Agent.objects.count() == len(names)  # one registration each: refusals stored nothing
