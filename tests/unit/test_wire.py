"""The wire codec (agents/protocol/wire.py): round trips, and wrong-format frames refused.

Here: the unit tests (no database, socket or process); the rest are in tests/integration/test_wire.py.
"""

from __future__ import annotations

import json

import msgpack
import pytest

from agents.protocol import wire
from agents.protocol.wire import WireFormatError

PACKET = {
    "outbox_id": 17,
    "task_execution_id": "7f9c2b1e-8a40-4f5e-9a53-2b0f7f7c1d11",
    "assignment": 3,
    "attempt": 1,
    "task_name": "extract",
    "function": "etl_demo.steps:extract",
    "context_json": '{"rows": [1, 2, 3], "name": "Zoë"}',
    "artifact_digest": "ab" * 32,
    "package_kind": "native",
    "target_triple": "aarch64-unknown-linux-gnu",
    "timeout_s": 30.0,
    "tenant": "acme",
}

RESULT = {
    "outbox_id": 17,
    "assignment": 3,
    "outcome": "success",
    "output": {"nested": {"list": [1, 2.5, None, True, "ü"], "big": 2**63, "neg": -(2**63)}},
    "error_type": None,
}


@pytest.mark.parametrize("fmt", wire.SUPPORTED_FORMATS)
@pytest.mark.parametrize("obj", [PACKET, RESULT, {}])
def test_it_round_trips(fmt, obj):
    assert wire.decode(wire.encode(obj, fmt), fmt) == obj


def test_json_is_readable_text_and_msgpack_compact_bytes():
    text = wire.encode(PACKET, "json")
    packed = wire.encode(PACKET, "msgpack")
    assert isinstance(text, str) and isinstance(packed, bytes)
    assert '"task_name":"extract"' in text and "Zoë" in text  # not \u-escaped
    assert json.loads(text) == PACKET and msgpack.unpackb(packed) == PACKET
    assert len(packed) < len(text.encode())
    assert wire.is_binary("msgpack") and not wire.is_binary("json")


def test_a_json_rest_body_may_arrive_as_utf8_bytes():
    assert wire.decode(wire.encode(RESULT, "json").encode(), "json") == RESULT


def test_tuples_travel_as_arrays_in_both_formats():
    for fmt in wire.SUPPORTED_FORMATS:
        assert wire.decode(wire.encode({"t": (1, "a")}, fmt), fmt) == {"t": [1, "a"]}


def test_a_msgpack_frame_read_as_json_is_refused():
    with pytest.raises(WireFormatError, match="expected a json frame.*MessagePack"):
        wire.decode(wire.encode(PACKET, "msgpack"), "json")


@pytest.mark.parametrize("as_bytes", [False, True])
def test_a_json_frame_read_as_msgpack_is_refused(as_bytes):
    frame = wire.encode(PACKET, "json")
    with pytest.raises(WireFormatError, match="expected a msgpack") as info:
        wire.decode(frame.encode() if as_bytes else frame, "msgpack")
    assert "JSON" in str(info.value)


@pytest.mark.parametrize("obj", [PACKET, RESULT, {"a": 1}])
def test_no_frame_of_one_format_decodes_in_the_other(obj):
    """Never a garbled task: every cross-format read fails, none yields some other object."""
    for fmt, other in (("json", "msgpack"), ("msgpack", "json")):
        frame = wire.encode(obj, fmt)
        with pytest.raises(WireFormatError):
            wire.decode(frame, other)
        if isinstance(frame, str):
            with pytest.raises(WireFormatError):
                wire.decode(frame.encode(), other)


@pytest.mark.parametrize(
    "data, fmt, problem",
    [
        ("[1, 2]", "json", "holds a list, not an object"),
        ('{"a": NaN}', "json", "not a finite number"),
        ("{not json", "json", "not JSON"),
        (b"\xc1", "msgpack", "unreadable"),
        (msgpack.packb([1, 2]), "msgpack", "holds a list"),
        (msgpack.packb({"blob": b"\x00\x01"}, use_bin_type=True), "msgpack", r"\$\.blob: bytes"),
        (msgpack.packb({"x": msgpack.ExtType(5, b"z")}), "msgpack", r"\$\.x: ExtType"),
        (msgpack.packb({"t": msgpack.Timestamp(1)}), "msgpack", r"\$\.t: Timestamp"),
        (msgpack.packb({1: "a"}, strict_types=False), "msgpack", "unreadable"),
        (b"", "msgpack", "unreadable"),
    ],
)
def test_bad_frames_are_refused_with_a_clear_message(data, fmt, problem):
    with pytest.raises(WireFormatError, match=problem):
        wire.decode(data, fmt)


@pytest.mark.parametrize("fmt", wire.SUPPORTED_FORMATS)
@pytest.mark.parametrize(
    "obj, problem",
    [
        ({"when": object()}, r"\$\.when: object is not a JSON type"),
        ({"a": {"b": [1, b"raw"]}}, r"\$\.a\.b\[1\]: bytes"),
        ({"n": float("nan")}, "not a finite number"),
        ({"n": 2**64}, "does not fit in 64 bits"),
        ({1: "one"}, "keys must be strings"),
        ([1, 2], "not an object"),
    ],
)
def test_encode_refuses_what_the_json_data_model_cannot_carry(fmt, obj, problem):
    with pytest.raises(WireFormatError, match=problem):
        wire.encode(obj, fmt)


def test_deep_nesting_is_refused():
    deep: dict = {}
    node = deep
    for _ in range(wire.MAX_DEPTH + 5):
        node["x"] = {}
        node = node["x"]
    for fmt in wire.SUPPORTED_FORMATS:
        with pytest.raises(WireFormatError, match="nested more than"):
            wire.encode(deep, fmt)
    with pytest.raises(WireFormatError, match="nested"):
        wire.decode('{"x":' * 100_000 + "1" + "}" * 100_000, "json")


def test_unknown_formats_and_mismatches_name_the_formats():
    with pytest.raises(
        WireFormatError, match="unknown wire format 'cbor'; supported: json, msgpack"
    ):
        wire.encode({}, "cbor")
    with pytest.raises(WireFormatError, match="unknown wire format"):
        wire.decode("{}", "yaml")
    wire.require_same_format("msgpack", "msgpack")
    with pytest.raises(WireFormatError) as info:
        wire.require_same_format("msgpack", "json")
    assert "server speaks msgpack" in str(info.value) and "agent speaks json" in str(info.value)


def test_a_server_set_to_auto_accepts_every_format_and_agents_default_to_msgpack():
    for fmt in wire.SUPPORTED_FORMATS:
        wire.require_same_format("auto", fmt)
    with pytest.raises(WireFormatError, match="unknown wire format 'cbor'"):
        wire.require_same_format("auto", "cbor")
    assert wire.DEFAULT_AGENT_FORMAT == "msgpack"


def test_an_extension_type_is_never_encoded():
    for fmt in wire.SUPPORTED_FORMATS:
        with pytest.raises(WireFormatError, match="ExtType"):
            wire.encode({"x": msgpack.ExtType(1, b"\x00")}, fmt)


@pytest.mark.parametrize("leaf", ["text", 7, True, None, 1.5, [], {}])
def test_the_depth_limit_counts_a_value_checked_in_place_as_one_level(leaf):
    """Strings, integers, booleans and nulls are checked where they stand (no call each):
    a value one level past the limit is still refused, one at the limit still passes."""

    def nested(levels: int) -> dict:
        top: dict = {}
        node = top
        for _ in range(levels - 1):
            node["x"] = {}
            node = node["x"]
        node["x"] = leaf
        return top

    for fmt in wire.SUPPORTED_FORMATS:
        wire.encode(nested(wire.MAX_DEPTH), fmt)  # the leaf at depth MAX_DEPTH
        with pytest.raises(WireFormatError, match="nested more than"):
            wire.encode(nested(wire.MAX_DEPTH + 1), fmt)
        with pytest.raises(WireFormatError, match="nested more than"):
            wire.encode({"a": [nested(wire.MAX_DEPTH)]}, fmt)


def test_an_integer_checked_in_place_is_still_held_to_64_bits():
    for fmt in wire.SUPPORTED_FORMATS:
        with pytest.raises(WireFormatError, match=r"\$\.a\[1\]: integer"):
            wire.encode({"a": [1, 2**64]}, fmt)
        with pytest.raises(WireFormatError, match=r"\$\.b: integer"):
            wire.encode({"b": -(2**63) - 1}, fmt)
