"""A heartbeat's metrics are measured (json.dumps) only when the frame is large enough to
hold too much (agents/surface/consumers.py, METRICS_JSON_GROWTH): the bound must hold for
the frames that grow the most when written as JSON, in both wire formats."""

from __future__ import annotations

import json

import pytest

from agents.protocol import wire
from agents.surface.consumers import METRICS_JSON_GROWTH, metrics_too_large
from fleet.executors.fleet.roster import MAX_METRICS_BYTES

# The most JSON per byte of frame: MessagePack's one-byte false/nil/small ints, JSON's
# "9e15" (eighteen characters written out), non-ASCII text (six-character \u escapes).
GROWERS = {
    "false": [False] * 4000,
    "nil": [None] * 4000,
    "negative": [-32] * 4000,
    "empty keys": {str(i): False for i in range(1500)},
    "non-ascii": ["é" * 50] * 80,
    "exponent": [9e15] * 1500,
}


def beat(metrics: object) -> dict:
    return {"type": "heartbeat", "metrics": {"m": metrics}, "running": []}


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
@pytest.mark.parametrize("name", sorted(GROWERS))
def test_metrics_grow_at_most_the_bound_when_written_as_json(fmt: str, name: str) -> None:
    frame = beat(GROWERS[name])
    data = wire.encode(frame, fmt)
    if fmt == "json" and name == "exponent":
        data = data.replace("9000000000000000.0", "9e15")  # what an agent may send
    size = len(data.encode()) if isinstance(data, str) else len(data)
    written = len(json.dumps(wire.decode(data, fmt)["metrics"]))
    assert written <= size * METRICS_JSON_GROWTH


def test_metrics_over_the_limit_are_measured_and_refused() -> None:
    large = {"pad": "m" * MAX_METRICS_BYTES}
    assert metrics_too_large(large)  # no size given: always measured
    assert metrics_too_large(large, MAX_METRICS_BYTES + 20)
    small = {"cpu_percent": 3.5, "load": [0.1, 0.2]}
    assert not metrics_too_large(small)
    assert not metrics_too_large(small, 60)
