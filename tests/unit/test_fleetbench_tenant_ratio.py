"""`fleetbench --tenant-ratio` and `--pages`: their options, the order of the ratio's runs
and its table (the end-to-end runs are in tests/e2e/test_fleetbench_tenant_ratio.py)."""

from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command

from fleet.bench.pages import PagesResult, PageTimes
from fleet.bench.scale import ScaleSettings
from fleet.bench.tenant_ratio import RatioPhase, TenantRatioResult, phase_order

SWARM = ["--executor", "fleet", "--simulated-agents", "20"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([*SWARM, "--tenant-ratio", "1"], "--tenant-ratio needs --simulated-agents N and --tenants T >= 2"),
        (["--tenant-ratio", "1"], "--tenant-ratio needs --simulated-agents N"),
        ([*SWARM, "--tenants", "4", "--tenant-ratio", "-1"], "--tenant-ratio must be >= 0"),
        (["--pages", "-5"], "--pages must be >= 0"),
        (["--pages", "100", "--page-requests", "0"], "--page-requests >= 1"),
    ],
)  # fmt: skip
def test_it_refuses_bad_options_before_touching_a_database(args, message):
    with pytest.raises(CommandError, match=message):
        call_command("fleetbench", *args)


def test_rounds_alternate_which_kind_runs_first():
    assert phase_order(10, 1) == [1, 10]
    assert phase_order(10, 2) == [1, 10, 10, 1]
    assert phase_order(4, 3) == [1, 4, 4, 1, 1, 4]


def _ratio(one_rate: float, many_rate: float, deadlocks: int) -> TenantRatioResult:
    one = RatioPhase(1, runs=1, tasks=1000, wall_s=1000 / one_rate, server_cpu_s=3.0)
    many = RatioPhase(10, runs=1, tasks=1000, wall_s=1000 / many_rate, deadlocks=deadlocks)
    settings = ScaleSettings(agents=1000, tenants=10, tasks=1000)
    return TenantRatioResult(settings, one, many, [(1, one_rate, 0), (10, many_rate, 0)], [])


def test_the_table_gives_the_share_and_whether_the_target_is_met():
    met = _ratio(200.0, 190.0, 0)
    assert met.share == pytest.approx(0.95)
    table = met.table()
    assert "10 tenants vs 1: 95 % of the single-tenant throughput, 0 deadlocks" in table
    assert "(target >= 90 % and 0: met)" in table
    assert "runs in order: 1: 200/s (0 deadlocks), 10: 190/s (0 deadlocks)" in table
    assert "NOT met" in _ratio(200.0, 170.0, 0).table()  # 85 %
    assert "NOT met" in _ratio(200.0, 200.0, 1).table()  # a deadlock


def test_the_pages_table_gives_p50_p95_and_server_cpu_per_page():
    page = PageTimes("GET /api/v1/fleet", [10.0, 20.0, 30.0, 40.0, 50.0], server_cpu_ms=7.5)
    assert page.percentile(50) == 30.0 and page.percentile(95) == pytest.approx(48.0)
    table = PagesResult(1000, 5, [page]).table()
    assert "1000 agents in tenant 'pages', 5 requests a page" in table
    assert table.splitlines()[-1].split()[-3:] == ["30.0", "48.0", "7.5"]
