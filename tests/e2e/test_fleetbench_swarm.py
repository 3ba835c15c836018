"""`fleetbench --simulated-agents` end to end at a small scale: a real `serve`, a swarm of
the runtime's own agents over real WebSockets, and the table it prints.

Here: the end-to-end test (real processes); the rest are in tests/unit/test_fleetbench_swarm.py.
No timing targets: the figures this machine reaches under load are the README's business.
"""

from __future__ import annotations

import re

import pytest

from tests.support.processes import Processes

AGENTS, TENANTS, TASKS = 30, 3, 200


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


def _figures(stdout: str) -> dict[str, str]:
    """``name  value`` lines of the table (names are words separated by single spaces)."""
    rows = (re.match(r"^(\S+(?: \S+)*)\s{2,}(.+)$", line) for line in stdout.splitlines())
    return {row.group(1): row.group(2) for row in rows if row}


@pytest.mark.e2e
def test_a_swarm_connects_idles_without_evictions_and_completes_every_task_once(procs):
    from fleet.models import Tenant

    Tenant.objects.create(name="untouched")
    result = procs.manage(
        "fleetbench", "--executor", "fleet", "--simulated-agents", str(AGENTS),
        "--tenants", str(TENANTS), "--tasks", str(TASKS), "--width", "10",
        # Short liveness windows, so three of them pass in seconds; a beat every 2 s leaves
        # a healthy agent 6 s of silence, room enough on a loaded 2-core machine.
        "--heartbeat-interval", "2", "--liveness-misses", "3", "--liveness-windows", "3",
        # Fewer agents per key than the tenant has: several agent keys per tenant.
        "--agents-per-key", "4", "--poll", "0.2", timeout=280,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("fleetbench: executor=fleet simulated-agents=30 tenants=3")
    figures = _figures(result.stdout)
    assert figures["agents connected"] == f"{AGENTS}/{AGENTS}"
    assert figures["quiet window s"] == "18.0 (3 liveness windows)"
    assert figures["evictions"] == "0 (connect + idle: 0)"
    assert figures["dispatch tasks"] == f"{TASKS} (failed 0)"
    assert figures["completed exactly once"] == f"{TASKS}/{TASKS}"
    assert figures["simulated runs"] == str(TASKS)
    assert figures["agents drained"] == f"{AGENTS}/{AGENTS}"
    assert figures["pg deadlocks"] == "0"
    for name in ("registrations/s", "idle server CPU %", "server KB/agent", "dispatch tasks/s"):
        assert re.match(r"^-?\d+(\.\d+)?\b", figures[name]), (name, figures[name])
    # The bench ran in its own database: the test's is untouched.
    assert list(Tenant.objects.values_list("name", flat=True)) == ["untouched"]
