"""Version gating: the server refuses, at registration, an agent whose protocol version it
does not speak, naming both versions; the agent stops with that message and exit code 2.

Here: the end-to-end tests (real processes); the rest are in tests/integration/test_version_gating.py.
"""

from __future__ import annotations

import pytest

from agents.models import Agent
from agents.protocol.triples import host_triple
from agents.runtime.agent_config import ENV_PROTOCOL_VERSION_OVERRIDE
from fleet.executors.fleet import roster
from tests.support.keys import cli_agent_key
from tests.support.processes import AGENT_READY, Processes, start_agent

EXIT_CONFIG = 2

REFUSAL = "agent speaks protocol 2, this server supports 1"


def registration(protocol_version: int, version: str = "cloacina-agent/9.0") -> roster.Registration:
    return roster.Registration(
        name="w1", target_triple=host_triple(), protocol_version=protocol_version, version=version
    )


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


@pytest.mark.e2e
def test_an_agent_of_another_protocol_exits_2_with_both_versions(procs):
    server = procs.serve()
    assert procs.manage("createtenant", "acme").returncode == 0
    key = cli_agent_key(procs)

    current = start_agent(procs, server, key, "current", wait=False)
    future = start_agent(
        procs,
        server,
        key,
        "future",
        env=procs.env(**{ENV_PROTOCOL_VERSION_OVERRIDE: "2"}),
        wait=False,
    )
    assert future.popen.wait(60) == EXIT_CONFIG, future.tail()
    last = future.output().strip().splitlines()[-1]
    assert "stopped: the server refused the registration" in last and REFUSAL in last, last
    assert key not in future.output()
    # The same agent speaking the server's protocol is let in: the version was the reason.
    current.wait_for_output(AGENT_READY, 60)
    assert list(Agent.objects.values_list("name", "protocol_version")) == [("current", 1)]
