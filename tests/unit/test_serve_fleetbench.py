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
