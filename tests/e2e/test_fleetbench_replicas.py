"""`fleetbench --replicas N`: N fleet servers on the bench database, agents spread over them."""

from __future__ import annotations

import pytest

from fleet.bench.replicas import server_order
from tests.support.processes import Processes

pytestmark = pytest.mark.e2e


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


def test_each_agent_starts_on_its_own_replica_and_lists_the_others():
    urls = ["http://a", "http://b", "http://c"]
    assert [server_order(urls, i) for i in range(4)] == [
        "http://a,http://b,http://c",
        "http://b,http://c,http://a",
        "http://c,http://a,http://b",
        "http://a,http://b,http://c",
    ]


def test_fleetbench_replicas_runs_the_work_through_every_replica(procs):
    result = procs.manage(
        "fleetbench", "--replicas", "2", "--agents", "2", "--tasks", "40", "--width", "4",
        "--poll", "0.2", timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("fleetbench: executor=fleet replicas=2 agents=2"), lines[0]
    assert "idle_db_connections=" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(("burst", "drain"))}
    burst_tasks, drain_tasks = rows["burst"][4:6], rows["drain"][4:6]
    assert burst_tasks == ["40", "0"] and drain_tasks == ["40", "0"], lines  # none failed


def test_fleetbench_refuses_a_negative_replica_count(procs):
    result = procs.manage("fleetbench", "--replicas", "-1", timeout=60)
    assert result.returncode != 0
    assert "--replicas must be >= 0, got -1" in result.stderr
