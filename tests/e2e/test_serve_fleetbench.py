"""`fleetbench` end to end on a tiny workload: its own database, a real server, a table.

Here: the end-to-end tests (real processes); the rest are in tests/unit/test_serve_fleetbench.py.
"""

from __future__ import annotations

import math
import re

import pytest
from django.db import connection

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
    # The idle row's CPU per task (server, database), counted above the quiet background.
    assert all(float(cell) >= 0 for cell in rows["idle"][-2:]), rows["idle"]
    assert "cloacina_bench" in result.stderr
    # The database it names is shown without its password (the test database has one).
    password = connection.settings_dict["PASSWORD"]
    assert password and password not in result.stderr and password not in result.stdout
    assert re.search(r"using database postgresql://\w+:\*\*\*@\S*/cloacina_bench", result.stderr)
    assert list(Tenant.objects.values_list("name", flat=True)) == ["untouched"]


@pytest.mark.e2e
def test_fleetbench_fleet_runs_every_phase_on_real_agents(procs):
    """The fleet variant end to end: a real server and two real agents through the burst,
    the drain, the idle pickups (with their CPU above the background) and a failover."""
    result = procs.manage(
        "fleetbench", "--executor", "fleet", "--agents", "2", "--tasks", "8", "--width", "4",
        "--idle-samples", "3", "--poll", "0.2", timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    settings = dict(word.split("=", 1) for word in lines[0].split()[1:] if "=" in word)
    assert settings["executor"] == "fleet" and settings["tasks"] == "8"
    background = dict(pair.split(":") for pair in settings["background_cpu_ms/s"].split(","))
    assert set(background) == {"server", "database", "agents"}
    assert all(int(ms) >= 0 for ms in background.values())
    assert float(settings["agents_cpu_ms/task(idle)"]) >= 0
    rows = {}
    for line in lines:
        if line.startswith(("burst", "drain", "idle", "failover")):
            name, *cells = re.split(r"\s{2,}", line.strip())
            rows[name.split()[0]] = cells
    assert rows["burst"][:2] == ["8", "0"] and rows["drain"][:2] == ["8", "0"]
    assert rows["idle"][:2] == ["3", "0"]
    assert all(float(cell) >= 0 for cell in rows["idle"][-2:]), rows["idle"]
    assert rows["failover"][:2] == ["1", "0"]  # the killed agent's task finished on the other


@pytest.mark.e2e
def test_fleetbench_refuses_a_negative_rate(procs):
    result = procs.manage("fleetbench", "--paced-rate", "-5", timeout=60)
    assert result.returncode != 0
    assert "--paced-rate must be >= 0, got -5" in result.stderr


def _rest_rows(stdout: str) -> dict[str, list[str]]:
    """The rows of a --client rest table by their name (the words before the numbers)."""
    rows = {}
    for line in stdout.splitlines():
        if line.startswith(("rest", "POST", "GET")):
            name, *cells = re.split(r"\s{2,}", line.strip())  # columns: two spaces or more
            rows[name] = cells
    return rows


@pytest.mark.e2e
@pytest.mark.parametrize("executor", ["default", "fleet"])
def test_fleetbench_client_rest_submits_and_polls_like_a_user(procs, executor):
    result = procs.manage(
        "fleetbench", "--client", "rest", "--executor", executor, "--agents", "1",
        "--tasks", "30", "--width", "3", "--clients", "2", "--poll", "0.2", timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith(f"fleetbench: executor={executor} client=rest users=2")
    assert "executions=10x3" in lines[0]
    rows = _rest_rows(result.stdout)
    assert rows["rest (server clock)"][:2] == ["30", "0"]  # 30 tasks, none failed
    assert rows["rest (client clock)"][:2] == ["30", "0"]
    assert float(rows["rest (client clock)"][3]) > 0  # tasks/s by the users' clock
    # The request table: 10 of each timed on the idle server, with the server's CPU.
    for name in ("POST start (idle)", "GET execution (idle)"):
        assert rows[name][0] == "10" and math.isfinite(float(rows[name][-1])), rows
    assert rows["POST start (run)"][0] == "10"
    assert int(rows["GET execution (run)"][0]) >= 10  # at least one poll per execution


@pytest.mark.e2e
def test_fleetbench_client_rest_refuses_more_users_than_executions(procs):
    result = procs.manage(
        "fleetbench", "--client", "rest", "--tasks", "20", "--width", "10", "--clients", "3",
        timeout=60,
    )  # fmt: skip
    assert result.returncode != 0
    assert "--clients (3) must not exceed the executions (--tasks / --width = 2)" in result.stderr
