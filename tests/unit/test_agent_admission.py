"""The per-process admission of agents (registrations and socket opens per second)."""

from __future__ import annotations

import pytest

from fleet.executors.fleet.delivery.admission import BURST_S, Admission, retry_after_s
from tests.support.clock import ManualClock


def test_a_burst_of_one_second_is_admitted_then_callers_are_told_to_wait():
    clock = ManualClock(1000.0)
    gate = Admission(10.0, clock)
    admitted = [gate.admit() for _ in range(int(10 * BURST_S) + 1)]
    assert admitted == [0.0] * len(admitted)
    assert gate.admit() > 0


def test_callers_refused_together_get_turns_spread_at_the_rate():
    clock = ManualClock(1000.0)
    gate = Admission(10.0, clock)
    while gate.admit() == 0.0:
        pass
    waits = [gate.admit() for _ in range(50)]
    steps = [later - earlier for earlier, later in zip(waits, waits[1:], strict=False)]
    assert all(step == pytest.approx(0.1) for step in steps)  # one turn each, 1/rate apart
    assert waits[-1] == pytest.approx(waits[0] + 4.9)


def test_the_rate_refills_with_time_and_zero_means_unlimited():
    clock = ManualClock(1000.0)
    gate = Admission(10.0, clock)
    while gate.admit() == 0.0:
        pass
    clock.now += 0.5
    assert gate.admit() == 0.0  # half a second later there is room again
    unlimited = Admission(0.0, clock)
    assert all(unlimited.admit() == 0.0 for _ in range(10_000))


def test_a_wait_becomes_whole_seconds_of_at_least_one():
    assert retry_after_s(0.01) == 1 and retry_after_s(2.2) == 3
