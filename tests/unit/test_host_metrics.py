"""The host metrics an agent reports (registration and every heartbeat).

There is no GPU on this machine: the nvidia-smi cases run a stand-in executable that
prints what the real one prints for ``--query-gpu … --format=csv,noheader,nounits``.

Here: the unit tests (no database, socket or process); the rest are in tests/integration/test_host_metrics.py.
"""

from __future__ import annotations

from agents.runtime.backoff import HEARTBEAT_JITTER, jittered


def test_heartbeats_are_jittered_by_ten_percent():
    intervals = [jittered(10.0) for _ in range(2000)]
    assert HEARTBEAT_JITTER == 0.10
    assert all(9.0 <= i <= 11.0 for i in intervals)
    assert min(intervals) < 9.2 and max(intervals) > 10.8  # spread over the whole range
