"""`fleetbench` end to end on a tiny workload: its own database, a real server, a table.

Here: the end-to-end tests (real processes); the rest are in tests/unit/test_serve_fleetbench.py.
"""

from __future__ import annotations

import pytest

from tests.support.processes import Processes


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


@pytest.mark.e2e
def test_fleetbench_prints_a_table_and_leaves_the_test_database_alone(procs):
    from fleet.models import Tenant

    Tenant.objects.create(name="untouched")
    result = procs.manage(
        "fleetbench", "--tasks", "40", "--width", "4", "--idle-samples", "3", "--poll", "0.2",
        "--paced-rate", "200", timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("fleetbench: executor=default") and "tasks=40" in lines[0]
    phases = ("burst", "drain", "paced", "idle")
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(phases)}
    assert rows["burst"][1:3] == ["40", "0"]  # 40 tasks, none failed
    assert rows["drain"][1:3] == ["40", "0"]  # the same again, queued at once
    assert rows["paced"][1:4] == ["200/s", "40", "0"]  # and submitted at a steady rate
    assert rows["idle"][2:4] == ["3", "0"]
    assert "cloacina_bench" in result.stderr
    assert list(Tenant.objects.values_list("name", flat=True)) == ["untouched"]


@pytest.mark.e2e
def test_fleetbench_refuses_a_negative_rate(procs):
    result = procs.manage("fleetbench", "--paced-rate", "-5", timeout=60)
    assert result.returncode != 0
    assert "--paced-rate must be >= 0, got -5" in result.stderr
