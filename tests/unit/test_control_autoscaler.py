"""The autoscaler: the decision table (time passed in, never slept) and the tick on a real DB.

Here: the unit tests (no database, socket or process); the rest are in tests/integration/test_control_autoscaler.py.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from fleet.control.autoscaler import DOWN, HOLD, UP, Policy, Signal, decide

NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)

POLICY = Policy(up_threshold=0.8, down_threshold=0.2, floor=1, cooldown_s=60)


def sig(desired=2, limit=4, live=None, in_flight=0, capacity=None, backlog=0, last=None):
    live = desired if live is None else live
    capacity = live * 4 if capacity is None else capacity
    return Signal(1, desired, limit, live, in_flight, capacity, backlog, last)


# (signal, expected action, expected new desired_count, words in the reason)
TABLE = [
    # utilization above the up threshold, room under the limit → +1
    (sig(desired=2, in_flight=7), UP, 3, "utilization 0.88 > 0.8"),
    (sig(desired=2, in_flight=0, capacity=10), DOWN, 1, "utilization 0.00 < 0.2"),
    # exactly at either threshold is not beyond it → hold in the band
    (sig(desired=2, in_flight=8, capacity=10), HOLD, 2, "within [0.2, 0.8]"),
    (sig(desired=2, in_flight=5, capacity=10), HOLD, 2, "within"),
    (sig(desired=2, in_flight=2, capacity=10), HOLD, 2, "within"),
    # at the effective limit: hold however hot
    (sig(desired=4, limit=4, in_flight=16), HOLD, 4, "at the effective limit (4)"),
    # cold, but at the floor (1): hold; the floor binds only the autoscaler
    (sig(desired=1, in_flight=0), HOLD, 1, "at the floor (1)"),
    # cold above the floor → −1
    (sig(desired=3, in_flight=1, capacity=12), DOWN, 2, "< 0.2 and no backlog"),
    # cold utilization but work is waiting: not a reason to shrink
    (sig(desired=3, in_flight=1, capacity=12, backlog=1), HOLD, 3, "within"),
    # zero agents, queued work → scale up from zero
    (sig(desired=0, live=0, capacity=0, backlog=3), UP, 1, "backlog 3 > 0 free slot(s)"),
    # zero agents, nothing waiting → hold (nothing to measure)
    (sig(desired=0, live=0, capacity=0), HOLD, 0, "no live agents and no backlog"),
    # busy agents with a backlog bigger than the spare slots → +1
    (sig(desired=1, in_flight=3, capacity=4, backlog=2), UP, 2, "backlog 2 > 1 free slot(s)"),
    # requested agents not up yet: do not run the count up to the limit
    (sig(desired=2, live=1, in_flight=4, capacity=4), HOLD, 2, "1 requested agent(s) not live yet"),
    # cooldown holds both directions…
    (
        sig(desired=2, in_flight=8, last=NOW - timedelta(seconds=30)),
        HOLD,
        2,
        "cooling down (30s left)",
    ),
    (
        sig(desired=3, in_flight=0, last=NOW - timedelta(seconds=59)),
        HOLD,
        3,
        "cooling down (1s left)",
    ),
    # …and releases them once it has passed
    (sig(desired=2, in_flight=8, last=NOW - timedelta(seconds=60)), UP, 3, "utilization 1.00"),
    (sig(desired=3, in_flight=0, last=NOW - timedelta(seconds=61)), DOWN, 2, "< 0.2"),
]


@pytest.mark.parametrize(("signal", "action", "new", "words"), TABLE)
def test_the_decision_table(signal, action, new, words):
    decision = decide(signal, POLICY, NOW)
    assert (decision.action, decision.new_desired) == (action, new), decision.reason
    assert words in decision.reason


def test_a_zero_floor_lets_it_scale_to_zero():
    decision = decide(sig(desired=1, in_flight=0), Policy(floor=0), NOW)
    assert (decision.action, decision.new_desired) == (DOWN, 0)
