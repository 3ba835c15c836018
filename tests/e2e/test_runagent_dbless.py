"""The agent is DB-less: its runtime imports no model (no Django at all), `runagent` refuses
any database connection, and a real agent with an unreachable DATABASE_URL still registers
and runs work against a live server.

Here: the end-to-end tests (real processes); the rest are in tests/integration/test_runagent_dbless.py.
"""

from __future__ import annotations

import pytest

from agents.models import Agent
from fleet.models import TaskExecution
from tests.support.keys import cli_agent_key, cli_tenant_key
from tests.support.processes import (
    SHORT_REDELIVERY,
    Processes,
    fleet_serve,
    start_agent,
)
from tests.support.server_api import start, upload, wait_terminal
from tests.support.workloads import agent_package

NOWHERE_DB = "postgresql://nowhere.invalid/x"


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_an_agent_with_no_reachable_database_registers_and_runs_a_task(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        key = cli_tenant_key(procs)
        akey = cli_agent_key(procs)
        server = fleet_serve(procs, **SHORT_REDELIVERY)
        upload(server, key, agent_package(task="quick"))
        agent_env = procs.env(DATABASE_URL=NOWHERE_DB)
        agent = start_agent(procs, server.url, akey, "dbless", env=agent_env)

        execution_id = start(server, key, "agentwf", {"n": 41})
        body = wait_terminal(server, key, execution_id, timeout=30)

        assert body["status"] == "Completed", body
        assert body["context"]["n"] == 42
        assert body["tasks"][0]["agent"] == "dbless"
        assert TaskExecution.objects.get(workflow_execution_id=execution_id).agent.name == "dbless"
        assert Agent.objects.get(name="dbless").state == "live"
        log = agent.output()
        assert "DB-less" not in log and "Traceback" not in log
        assert agent.stop() == 0
