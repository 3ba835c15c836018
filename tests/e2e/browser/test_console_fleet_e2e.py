"""The console on a real fleet: `serve --default-executor fleet`, a real `runagent`, real Chromium.

SIGKILL the agent process and watch the console notice, without a reload: the
overview loses the live agent and flags the missing one, and the eviction
history shows it once the server's liveness sweep declares it dead.
"""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.support.keys import cli_agent_key
from tests.support.processes import Processes, fleet_serve, start_agent

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

PASSWORD = "pw-fleet-e2e-123"
EVICTED_WITHIN_S = 20  # 0.5 s heartbeats × 3 misses, the sweep period, polling, a busy machine


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


def _cli(procs: Processes, *args: str, input: str | None = None) -> None:
    result = procs.manage(*args, input=input)
    assert result.returncode == 0, result.stderr


def test_a_killed_agent_shows_up_in_the_console(page, procs):
    # The real server polls at the console's own 2 s (fast_polling only patches this process).
    server = fleet_serve(procs)
    _cli(procs, "createtenant", "acme")
    _cli(
        procs, "createconsoleuser", "ops", "--superuser", "--password-stdin", input=PASSWORD + "\n"
    )
    agent = start_agent(procs, server, cli_agent_key(procs), "doomed-agent", slots=2)

    page.goto(f"{server.url}/console/")
    page.fill("input[name=username]", "ops")
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"{server.url}/console/")
    page.locator("#tenant-row-acme button[name=provision]").click()
    expect(page.locator("#desired-acme")).to_have_text("1", timeout=10_000)
    row = page.locator("#tenant-row-acme")
    expect(row).to_contain_text("1 / 1")  # agents live / total
    expect(row.locator(".problems")).to_contain_text("ok")
    page.evaluate("window.__stillTheSamePage = true")

    agent.kill_group()  # SIGKILL: no deregistration, the heartbeats just stop
    expect(row.locator(".problems")).to_contain_text(
        "1 of 1 desired agent(s) missing", timeout=EVICTED_WITHIN_S * 1000
    )
    expect(row).to_contain_text("0 / 0")
    expect(row.locator(".problems")).to_contain_text("1 eviction(s) in the last hour")
    assert page.evaluate("window.__stillTheSamePage === true")

    page.goto(f"{server.url}/console/evictions/")
    eviction = page.locator('#evictions tr[data-agent="doomed-agent"]')
    expect(eviction).to_contain_text("no heartbeat for")
    page.goto(f"{server.url}/console/tenants/acme/")
    expect(page.locator('tr[data-agent="doomed-agent"]')).to_contain_text("dead")
