"""`fleetbench --tenant-ratio` and `fleetbench --pages` end to end at a small scale: real
`serve` processes, a swarm of the runtime's own agents over real WebSockets, real HTTP.

No timing targets (the README's business): what is checked is that each mode runs its
phases, completes every task, and prints the figures it promises.
"""

from __future__ import annotations

import re

import pytest

from tests.support.processes import Processes

AGENTS, TENANTS, TASKS = 12, 3, 120


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


@pytest.mark.e2e
def test_the_tenant_ratio_dispatches_with_one_tenant_then_many(procs):
    result = procs.manage(
        "fleetbench", "--executor", "fleet", "--simulated-agents", str(AGENTS),
        "--tenants", str(TENANTS), "--tasks", str(TASKS), "--width", "10",
        "--tenant-ratio", "1", "--heartbeat-interval", "5", "--poll", "0.2", timeout=280,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert out.startswith(f"fleetbench: tenant ratio, simulated-agents={AGENTS} tasks={TASKS}")
    rows = {
        int(m.group(1)): (int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5)))
        for m in re.finditer(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(\d+)$",
                             out, re.MULTILINE)
    }  # fmt: skip
    # tenants → (runs, tasks, failed, deadlocks): each kind ran once, every task completed.
    assert rows == {1: (1, TASKS, 0, 0), TENANTS: (1, TASKS, 0, 0)}, out
    assert re.search(r"runs in order: 1: \d+/s \(0 deadlocks\), 3: \d+/s \(0 deadlocks\)", out)
    assert re.search(rf"{TENANTS} tenants vs 1: \d+ % of the single-tenant throughput, 0 dead", out)
    # Each run's line went to stderr as it ended.
    assert len(re.findall(r"tenant\(s\): \d+ tasks/s, 0 deadlocks", result.stderr)) == 2


@pytest.mark.e2e
def test_the_pages_bench_times_the_fleet_api_and_the_tenant_page(procs):
    result = procs.manage("fleetbench", "--pages", "60", "--page-requests", "3", timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "fleetbench: pages, 60 agents in tenant 'pages', 3 requests a page" in out
    for page in ("GET /api/v1/fleet (100 agents a page)", "console tenant page (whole page)",
                 "console tenant agents table (polled partial)"):  # fmt: skip
        row = next(line for line in out.splitlines() if line.startswith(page))
        p50, p95, cpu = (float(x) for x in row[len(page) :].split())
        assert 0 < p50 <= p95 and cpu >= 0, row
