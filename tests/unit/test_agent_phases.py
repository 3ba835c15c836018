"""An agent's phase and breaker state, derived from its row's columns (no query)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from fleet.executors.fleet.routing.phases import Phase, of
from fleet.executors.fleet.state.breaker import BreakerState, state_of


@pytest.mark.parametrize(
    ("state", "connected", "generation", "in_flight", "slots", "phase"),
    [
        ("live", False, 0, 0, 2, Phase.CONNECTING),  # registered, never opened a socket
        ("live", True, 1, 0, 2, Phase.READY),
        ("live", True, 1, 1, 2, Phase.READY),  # a free slot left
        ("live", True, 1, 2, 2, Phase.BUSY),
        ("live", True, 1, 3, 2, Phase.BUSY),  # over (a lowered max_concurrency)
        ("live", False, 4, 0, 2, Phase.DISCONNECTED),  # had a socket, lost it
        ("live", False, 4, 2, 2, Phase.DISCONNECTED),  # its load does not matter then
        ("draining", True, 1, 2, 2, Phase.DRAINING),
        ("draining", False, 1, 0, 2, Phase.DRAINING),
        ("stopped", False, 1, 0, 2, Phase.STOPPED),
        ("dead", False, 1, 0, 2, Phase.DEAD),
    ],
)
def test_the_phase_of_a_row(state, connected, generation, in_flight, slots, phase):
    assert of(state, connected, generation, in_flight, slots) == phase


def test_the_breaker_state_of_a_row():
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert state_of(None, now) == BreakerState.CLOSED
    assert state_of(now + timedelta(seconds=1), now) == BreakerState.OPEN
    assert state_of(now, now) == BreakerState.HALF_OPEN  # the cool-off is over
    assert state_of(now - timedelta(hours=1), now) == BreakerState.HALF_OPEN
