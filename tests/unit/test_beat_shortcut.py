"""The heartbeat shortcut (agents/surface/consumers.py, ``plain_beat``): a plain beat is
taken as the full check would take it, and anything else is left to the full check."""

from __future__ import annotations

import json
import uuid

import msgpack
import pytest

from agents.protocol import frames, wire
from agents.surface import consumers
from agents.surface.consumers import FrameRejected, plain_beat
from fleet.executors.fleet.roster import MAX_METRICS_BYTES

TASK = str(uuid.uuid4())
METRICS = {"cpu_count": 2, "cpu_pct": 12.5, "load_1m": 0.4, "host": "a", "gpu": None, "up": True}


def fully_checked(payload: bytes) -> dict:
    return consumers._check_frame(wire.decode(payload, "msgpack"), len(payload))


@pytest.mark.parametrize(
    "beat",
    [
        frames.heartbeat(0, [], METRICS, False),
        frames.heartbeat(3, [TASK], METRICS, True),
        frames.heartbeat(0, [], {}, False),
        {"type": "heartbeat", "in_flight": 0},  # what older agents send
        {"type": "heartbeat", "metrics": None, "running": None, "draining": None},
        {"type": "heartbeat", "metrics": {"big": 2**64 - 1, "neg": -(2**63)}},
    ],
)
def test_a_plain_beat_is_taken_as_the_full_check_takes_it(beat):
    payload = wire.encode(beat, "msgpack")
    taken = plain_beat(payload)
    assert taken is not None
    assert taken == fully_checked(payload)
    if beat.get("metrics") is not None:  # written as the agent sent it, decoded equal
        assert json.loads(taken["metrics_json"]) == beat["metrics"]


@pytest.mark.parametrize(
    "beat",
    [
        {"type": "heartbeat", "metrics": {"x": float("nan")}},
        {"type": "heartbeat", "metrics": {"x": float("inf")}},
        {"type": "heartbeat", "metrics": {"nested": {"a": 1}}},
        {"type": "heartbeat", "metrics": {"list": [1, 2]}},
        {"type": "heartbeat", "metrics": {"nul": "a\x00b"}},
        {"type": "heartbeat", "metrics": {"a\x00": 1}},
        {"type": "heartbeat", "metrics": {"blob": b"bytes"}},
        {"type": "heartbeat", "metrics": {"x": "y" * MAX_METRICS_BYTES}},
        {"type": "heartbeat", "metrics": [1, 2]},
        {"type": "heartbeat", "running": ["not-a-uuid"]},
        {"type": "heartbeat", "running": [7]},
        {"type": "heartbeat", "running": "x"},
        {"type": "heartbeat", "draining": "yes"},
        {"type": "heartbeat", "in_flight": 1.5},
        {"type": "heartbeat", "extra": 1},
        {"type": "received", "outbox_id": 1},
        {"type": "hello", "holding": []},
    ],
)
def test_anything_else_is_left_to_the_full_check(beat):
    payload = msgpack.packb(beat, use_bin_type=True)
    assert plain_beat(payload) is None


def test_frames_that_do_not_decode_are_left_to_the_full_check():
    payload = wire.encode(frames.heartbeat(0, [], METRICS, False), "msgpack")
    assert plain_beat(payload[:-3]) is None  # truncated
    assert plain_beat(payload + b"\x00") is None  # trailing data
    assert plain_beat(json.dumps({"type": "heartbeat"}).encode()) is None  # JSON
    ext = msgpack.packb({"type": "heartbeat", "metrics": {"x": msgpack.ExtType(1, b"z")}})
    assert plain_beat(ext) is None
    with pytest.raises((wire.WireFormatError, FrameRejected)):
        fully_checked(ext)  # which names the problem


@pytest.mark.parametrize(
    "metrics",
    [
        METRICS,
        {},
        {"big": 2**64 - 1, "neg": -(2**63), "tiny": 1e-300, "e": 1.5e300, "zero": -0.0},
        {"ünï": "cödé ☃ \U0001f600", 'q"uote': "back\\slash\n\t\x01"},
    ],
)
def test_the_metrics_text_is_json_dumps_text(metrics):
    assert consumers._flat_metrics_json(metrics) == json.dumps(metrics)


class Writes:
    def __init__(self) -> None:
        self.running = True


def test_a_socket_keeps_its_writer_while_it_runs(monkeypatch):
    made: list[Writes] = []
    monkeypatch.setattr(
        consumers.socket_writes, "writer", lambda: made.append(Writes()) or made[-1]
    )
    consumer = consumers.AgentDeliveryConsumer.__new__(consumers.AgentDeliveryConsumer)
    consumer._writes = None
    first = consumer._socket_writes()
    assert consumer._socket_writes() is first and len(made) == 1  # looked up once
    first.running = False  # closed (its loop, or close_writer): the current one is asked for
    assert consumer._socket_writes() is made[1]
