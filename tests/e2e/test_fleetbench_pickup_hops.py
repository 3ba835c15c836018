"""`fleetbench --pickup-hops`: a real server and agent trace each idle pickup, every hop
from Ready to `received` is matched and timed, and the floor of the database is printed."""

from __future__ import annotations

import pytest

from tests.support.processes import Processes

SAMPLES = 4


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


@pytest.mark.e2e
def test_every_hop_of_every_pickup_is_traced_and_timed(procs):
    from fleet.bench.pickup_hops import HOPS

    result = procs.manage(
        "fleetbench", "--executor", "fleet", "--agents", "1", "--pickup-hops", str(SAMPLES),
        "--poll", "0.2", timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith(f"fleetbench: pickup hops, {SAMPLES} idle pickups, 1 agents")
    assert "SELECT 1" in lines[0] and "1-row INSERT committed" in lines[0]
    counts = {}
    for line in lines:
        words = line.split()
        if len(words) > 5 and words[-5] == str(SAMPLES):
            counts[" ".join(words[:-5])] = int(words[-5])
    # Every hop (the server's, the agent's, the rows') was found for every pickup.
    assert set(counts) == {name for name, _ in HOPS} | {"Ready → received_at (whole path)"}
