"""Secrets: API keys are stored hashed (a database dump holds no usable key), compared in
constant time, revocable (everywhere at once, an open delivery socket included) and
carry a last-used timestamp; the keys actuators mint for their agents are never logged.

Here: the end-to-end tests (real processes); the rest are in tests/integration/test_secrets.py.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import psutil
import pytest
from django.test import Client

from fleet.executors.fleet.lifecycle import revoke_key
from fleet.models import ApiKey, Role
from tests.support.keys import bearer, cli_agent_key
from tests.support.processes import Processes, fleet_serve, start_agent
from tests.support.waiting import wait_until


def _secret_part(token: str) -> str:
    return token.split("_", 2)[2]


def pg_dump() -> str:
    """A plain-SQL dump of the test database, by the embedded server's own pg_dump."""
    import pgserver
    from django.db import connection

    s = connection.settings_dict
    binary = Path(pgserver.__file__).parent / "pginstall" / "bin" / "pg_dump"
    args = [str(binary), "--no-owner", "--dbname", s["NAME"], "--host", s["HOST"]]
    if s.get("USER"):
        args += ["--username", s["USER"]]
    if s.get("PORT"):
        args += ["--port", str(s["PORT"])]
    env = {**os.environ, "PGPASSWORD": s.get("PASSWORD") or ""}
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.django_db(transaction=True)
def test_a_database_dump_holds_no_usable_key(tmp_path):
    from fleet.control.actuators.base import mint_agent_key
    from tests.support.factories import make_tenant

    tenant = make_tenant("acme")
    tokens = {role: ApiKey.mint(role, tenant=tenant)[1] for role in ("agent", "read", "write")}
    tokens["admin"] = ApiKey.mint(Role.ADMIN)[1]
    tokens["actuator"] = mint_agent_key(tenant, "process actuator: acme-1")[1]
    with Processes(tmp_path) as procs:
        minted = procs.manage("mintkey", "--tenant", "acme", "--role", "write")
        assert minted.returncode == 0, minted.stderr
        tokens["cli"] = minted.stdout.strip()
    # Every key has been used, so last_used_at is set too.
    for role in ("read", "write", "cli"):
        assert Client().get("/api/v1/fleet", **bearer(tokens[role])).status_code == 200

    dump = pg_dump()
    assert "COPY public.fleet_apikey" in dump  # the table is in it…
    for name, token in tokens.items():
        key = ApiKey.verify(token)
        assert key is not None and key.key_hash in dump  # …with this key's row
        assert token not in dump, f"the {name} key is in the dump"
        assert _secret_part(token) not in dump, f"the {name} key's secret is in the dump"
        # What the dump does hold opens nothing.
        assert ApiKey.verify(f"clk_{key.lookup}_{key.key_hash}") is None
        assert Client().get("/api/v1/fleet", **bearer(key.key_hash)).status_code == 401


@pytest.mark.e2e
def test_a_revoked_key_stops_working_everywhere(transactional_db, tmp_path):
    """Revoked while its agent holds a delivery socket: REST refuses it at once, the agent is
    declared dead and its socket closed, and the agent stops (it cannot register again)."""
    from agents.models import Agent
    from tests.support.keys import cli_tenant_key

    with Processes(tmp_path) as procs:
        server = fleet_serve(procs)
        cli_tenant_key(procs)
        token = cli_agent_key(procs)
        agent = start_agent(procs, server, token, "doomed")
        key = ApiKey.verify(token)
        assert key is not None
        live = wait_until(
            lambda: Agent.objects.filter(api_key=key, state="live", connected_to__gt="").first(),
            what="the agent connected",
        )
        assert revoke_key(key) is True
        assert revoke_key(key) is False  # once
        assert ApiKey.verify(token) is None
        answer = httpx.get(
            server.api(f"/artifacts/{'0' * 64}"),
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        )
        assert answer.status_code == 401 and "revoked" in answer.json()["detail"]
        live.refresh_from_db()
        assert live.state == "dead"  # at once, not after the liveness timeout
        # The agent's socket is closed, it cannot register again, and it stops.
        code = agent.popen.wait(30)
        assert code == 3, agent.tail()
        assert "revoked" in agent.output() or "401" in agent.output(), agent.tail()
        assert not Agent.objects.filter(api_key=key).exclude(state="dead").exists()


def _assert_not_in(token: str, texts: dict[str, str]) -> None:
    for where, text in texts.items():
        assert token not in text, f"an agent key appears in {where}"
        assert _secret_part(token) not in text, f"an agent key's secret appears in {where}"


@pytest.mark.e2e
def test_the_process_actuators_keys_are_never_logged(transactional_db, tmp_path):
    """Real `serve --actuator process` starting real agents, every log at DEBUG: the keys
    (read back from the agents' environments) appear in no log of the server or an agent."""
    from agents.models import Agent
    from tests.support.keys import cli_tenant_key

    with Processes(tmp_path, CLOACINA_LOG_LEVEL="DEBUG") as procs:
        server = fleet_serve(
            procs,
            CLOACINA_FLEET_ACTUATOR="process",
            CLOACINA_AUTOSCALE="false",
            CLOACINA_AUTOSCALE_INTERVAL_S="0.3",  # the control tick that starts the agents
        )
        write = cli_tenant_key(procs)
        for _ in range(2):
            answer = httpx.post(
                server.api("/fleet/provision"),
                headers={"Authorization": f"Bearer {write}"},
                timeout=10,
            )
            assert answer.status_code == 200, answer.text
        wait_until(
            lambda: Agent.objects.filter(state="live", connected_to__gt="").count() == 2,
            timeout=60,
            what="two agents started by the process actuator",
        )
        children = [
            p
            for p in psutil.Process(server.process.pid).children(recursive=True)
            if "runagent" in " ".join(p.cmdline())
        ]
        tokens = {p.environ().get("CLOACINA_AGENT_API_KEY", "") for p in children}
        tokens.discard("")
        assert len(tokens) == 2
        for token in tokens:
            assert token not in " ".join(sum((p.cmdline() for p in children), []))
            assert ApiKey.verify(token) is not None  # they are the agents' real keys
        server.process.stop()
        logs = {"serve": server.process.output()}
        for path in procs.home.rglob("*.log"):
            logs[str(path)] = path.read_text(errors="replace")
        assert len(logs) >= 3, sorted(logs)  # the server's and each agent's
        for token in tokens:
            _assert_not_in(token, logs)
