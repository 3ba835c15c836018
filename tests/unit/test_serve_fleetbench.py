"""`fleetbench` end to end on a tiny workload: its own database, a real server, a table.

Here: the unit tests (no database, socket or process); the rest are in tests/e2e/test_serve_fleetbench.py.
"""

from __future__ import annotations

import pytest

from fleet.bench.workload import PhaseResult


def test_percentiles_and_throughput():
    phase = PhaseResult("p", tasks=100, wall_s=0.5, latencies_ms=[float(i) for i in range(1, 101)])
    assert phase.throughput == 200
    assert phase.percentile(50) == pytest.approx(50.5)
    assert phase.percentile(99) == pytest.approx(99.01)


# --- --client rest (fleet/bench/rest_client.py) ------------------------------------------


def test_the_rest_client_options_are_checked():
    from fleet.bench.rest_client import option_errors

    assert option_errors(executions=200, clients=4, poll_interval_s=0.01) == []
    assert option_errors(200, 0, 0.0) == ["--clients must be >= 1, got 0"]
    assert option_errors(3, 4, 0.0) == [
        "--clients (4) must not exceed the executions (--tasks / --width = 3)"
    ]
    assert option_errors(3, 1, -1) == ["--rest-poll-interval must be >= 0, got -1"]


def test_the_rest_client_table_shows_both_clocks_and_each_request():
    from fleet.bench.rest_client import RequestCost, RestClientResult
    from fleet.bench.workload import BenchResult

    phases = [
        PhaseResult("rest (server clock)", 100, 0.5, [1.0, 2.0], cpu={"server": 0.2}),
        PhaseResult("rest (client clock)", 100, 0.8, [30.0, 40.0]),
    ]
    result = RestClientResult(
        BenchResult("fleet", {"client": "rest", "users": 2}, phases),
        [
            RequestCost("GET execution (idle)", 4, [1.0, 2.0, 3.0, 9.0], 1.234),
            RequestCost("GET execution (run)", 2, [5.0, 7.0], None),
        ],
    )
    lines = result.table().splitlines()
    assert lines[0] == "fleetbench: executor=fleet client=rest users=2"
    rows = {
        line.split("  ")[0].strip(): line.split()
        for line in lines
        if line.startswith(("rest", "GET"))
    }
    assert rows["rest (server clock)"][3:7] == ["100", "0", "0.50", "200"]  # tasks/s by the server
    assert rows["rest (server clock)"][-2] == "2.00"  # server CPU ms per task
    assert rows["rest (client clock)"][3:7] == ["100", "0", "0.80", "125"]
    assert rows["GET execution (idle)"][3:] == ["4", "3.0", "9.0", "1.23"]
    assert rows["GET execution (run)"][3:] == ["2", "7.0", "7.0", "-"]


# --- the idle phase's pacing (fleet/bench/workload.py) --------------------------------------


def test_idle_pickups_are_paced_as_the_peers_trickle(monkeypatch):
    """Each start is followed by the peers' 20 ms gap with the client asleep, and only then
    a check that the execution is done: no poll while the pickup it measures happens."""
    from fleet.bench import workload

    calls: list[tuple] = []

    class FakeApi:
        def start(self, workflow: str) -> str:
            calls.append(("start", workflow))
            return f"e{len(calls)}"

    monkeypatch.setattr(workload.time, "sleep", lambda s: calls.append(("sleep", s)))
    monkeypatch.setattr(
        workload, "wait_finished", lambda ids, poll_s: calls.append(("wait", tuple(ids), poll_s))
    )
    ids = workload.idle_pickups(FakeApi(), 2)
    assert ids == ["e1", "e4"]
    assert calls == [
        ("start", workload.ONE_WORKFLOW),
        ("sleep", 0.02),
        ("wait", ("e1",), 0.005),
        ("start", workload.ONE_WORKFLOW),
        ("sleep", 0.02),
        ("wait", ("e4",), 0.005),
    ]


# --- CPU above the background (fleet/bench/cpu.py) -------------------------------------------


class _SteppedMeter:
    """A meter whose samples are given in order (CPU seconds per group)."""

    def __init__(self, *samples: dict[str, float]) -> None:
        self.samples = list(samples)

    def sample(self) -> dict[str, float]:
        return self.samples.pop(0)

    used = staticmethod(lambda before, after: {k: after[k] - before.get(k, 0.0) for k in after})


def test_cpu_window_counts_a_phase_above_the_background(monkeypatch):
    """The idle phase's CPU is what it used beyond the quiet window's rate over the same wall
    time, per group; a group that used less than its background counts zero, not less."""
    from fleet.bench import cpu

    clock = iter([100.0, 102.0, 200.0, 204.0])  # quiet: 2 s; the phase: 4 s
    monkeypatch.setattr(cpu.time, "monotonic", lambda: next(clock))
    meter = _SteppedMeter(
        {"server": 1.0, "database": 5.0},
        {"server": 1.06, "database": 5.02},  # background: 30 and 10 ms a second
        {"server": 2.0, "database": 6.0},
        {"server": 2.5, "database": 6.03},  # the phase: 500 and 30 ms in 4 s
    )
    quiet = cpu.CpuWindow.open(meter).close()
    assert quiet.rates() == pytest.approx({"server": 0.03, "database": 0.01})
    phase = cpu.CpuWindow.open(meter).close()
    assert phase.wall_s == 4.0
    assert phase.above(quiet) == pytest.approx({"server": 0.38, "database": 0.0})


def testidle_cpu_settings_name_the_background_and_the_agents_per_pickup():
    from fleet.bench import cpu
    from fleet.bench.fleet import idle_cpu_settings

    quiet = cpu.CpuWindow(None, {}, 0.0, used={"server": 0.3, "agents": 0.05}, wall_s=10.0)
    idle = PhaseResult("idle pickup", 100, 2.7, [5.0], cpu={"server": 0.6, "agents": 0.04})
    drain = PhaseResult("drain (queued)", 2000, 2.0, [1.0], cpu={"agents": 1.0})
    settings = idle_cpu_settings([drain, idle], quiet)
    assert settings == {
        "background_cpu_ms/s": "server:30,agents:5",
        "agents_cpu_ms/task(idle)": "0.40",
    }
    assert idle_cpu_settings([drain], quiet) == {"background_cpu_ms/s": "server:30,agents:5"}
