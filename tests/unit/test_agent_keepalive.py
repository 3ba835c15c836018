"""The agent pings its delivery socket once per liveness window (docs/agent-protocol.md,
"Agent conduct"): its beats prove it alive to the server, the pings prove the server alive
to it, and thousands of agents pinging every 20 s were nearly half an idle server's frames."""

from __future__ import annotations

from agents.runtime import connection


def test_the_ping_interval_is_one_liveness_window_and_never_below_websockets_default():
    assert connection.ping_interval_s(15.0, 3) == 45.0
    assert connection.ping_interval_s(60.0, 2) == 120.0
    assert connection.ping_interval_s(1.0, 3) == 20.0  # short test intervals: as before
