"""Leader election with two real `serve` processes on one database: exactly one drives the
fleet, and when it is killed the other takes over within about one tick."""

from __future__ import annotations

import os
import re
import signal
import time

import psutil
import pytest

from fleet.models import ApiKey, AutoscaleDecision, ServerInstance, Tenant
from tests.support.agents import live_agents, pid_of
from tests.support.processes import LEADER_LINE, Processes, control_env, diagnostics
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e

INTERVAL_S = 0.5
TICK_LINE = re.compile(r"fleet control tick by (\S+):")


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


def alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def ticks(serve) -> int:
    return len(TICK_LINE.findall(serve.process.output()))


def test_exactly_one_server_acts_and_a_survivor_takes_over(procs):
    tenant = Tenant.objects.create(name="acme", desired_count=1)
    ApiKey.mint("write", tenant)
    env = control_env(
        procs,
        CLOACINA_AUTOSCALE="true",
        CLOACINA_AUTOSCALE_FLOOR="1",  # an idle tenant holds at 1: one decision row per tick
        CLOACINA_AUTOSCALE_INTERVAL_S=str(INTERVAL_S),
        CLOACINA_LOG_LEVEL="DEBUG",  # every acting tick logs "fleet control tick by <server>"
    )
    first, second = procs.serve(env=env), procs.serve(env=env)
    logs = diagnostics(procs, first, second)
    [agent] = wait_until(
        lambda: live_agents(tenant), what="the leader to start one agent", logs=logs
    )
    by_pid = {first.process.pid: first, second.process.pid: second}
    leader = by_pid[pid_of(agent.name)]  # the process actuator names agents after its server
    follower = second if leader is first else first
    leader_id = LEADER_LINE.search(leader.process.output()).group(1)
    assert ServerInstance.objects.filter(id=leader_id, pid=leader.process.pid).exists()
    assert not LEADER_LINE.search(follower.process.output())

    # Exactly one acts per tick: over a few seconds every decision row has a tick of the leader
    # behind it, and the follower never runs the body at all.
    rows_before, ticks_before = AutoscaleDecision.objects.count(), ticks(leader)
    time.sleep(8 * INTERVAL_S)
    rows_after, ticks_after = AutoscaleDecision.objects.count(), ticks(leader)
    assert ticks_after - ticks_before >= 4, logs()
    assert abs((rows_after - rows_before) - (ticks_after - ticks_before)) <= 1
    assert ticks(follower) == 0
    assert set(TICK_LINE.findall(leader.process.output())) == {leader_id}
    assert {pid_of(a.name) for a in live_agents(tenant)} == {leader.process.pid}

    # Kill the leader outright (no shutdown hooks): its agents die with it (PDEATHSIG), its
    # session's advisory lock is released, and the follower leads from its next tick.
    children = [
        p for p in psutil.Process(leader.process.pid).children() if "runagent" in p.cmdline()
    ]
    assert len(children) == 1
    killed_at = time.monotonic()
    os.kill(leader.process.pid, signal.SIGKILL)
    wait_until(
        lambda: LEADER_LINE.search(follower.process.output()),
        what="the follower to take the leadership",
        timeout=10,
        logs=logs,
        interval=0.02,
    )
    takeover_s = time.monotonic() - killed_at
    print(f"leader takeover after {takeover_s:.2f}s (tick interval {INTERVAL_S}s)")
    assert takeover_s < 2 * INTERVAL_S + 1.0, f"takeover took {takeover_s:.2f}s"
    wait_until(
        lambda: not any(alive(c) for c in children),
        what="the dead leader's agent to die with it",
        timeout=5,
        logs=logs,
    )
    new_agent = wait_until(
        lambda: [a for a in live_agents(tenant) if pid_of(a.name) == follower.process.pid],
        what="the new leader to start its own agent",
        logs=logs,
    )
    assert len(new_agent) == 1
    assert ticks(follower) > 0
