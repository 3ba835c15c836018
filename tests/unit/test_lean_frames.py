"""The lean frame reader (cloacina_site/daphne_limits.py, ``one_lean_frame``): it unmasks
exactly what autobahn's masker unmasks, and leaves every other kind of read to autobahn."""

from __future__ import annotations

import os

import pytest
from autobahn.websocket.xormasker import create_xor_masker

from cloacina_site.daphne_limits import BINARY, LEAN_MAX_BYTES, PING, one_lean_frame


def frame(
    payload: bytes, *, first: int = 0x82, masked: bool = True, long_form: bool = False
) -> bytes:
    """A client frame: ``first`` is the FIN/RSV/opcode byte (0x82: final binary)."""
    size = len(payload)
    mask_bit = 0x80 if masked else 0
    if size < 126 and not long_form:
        header = bytes([first, mask_bit | size])
    elif size < 65536:
        header = bytes([first, mask_bit | 126]) + size.to_bytes(2, "big")
    else:
        header = bytes([first, mask_bit | 127]) + size.to_bytes(8, "big")
    if not masked:
        return header + payload
    mask = b"\x37\xfa\x21\x3d"  # fixed: the reads below are test ids
    return header + mask + create_xor_masker(mask, size).process(payload)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 125, 126, 127, 275, 1000, LEAN_MAX_BYTES])
def test_one_final_masked_binary_frame_is_unmasked_as_autobahn_unmasks_it(size):
    payload = os.urandom(size)
    assert one_lean_frame(frame(payload)) == (BINARY, payload)
    mask = os.urandom(4)  # any mask
    header = frame(payload)[: -size - 4]
    masked = header + mask + create_xor_masker(mask, size).process(payload)
    assert one_lean_frame(masked) == (BINARY, payload)


@pytest.mark.parametrize("size", [1, 4, 125])
def test_a_ping_is_unmasked_as_autobahn_unmasks_it(size):
    payload = os.urandom(size)
    assert one_lean_frame(frame(payload, first=0x89)) == (PING, payload)


@pytest.mark.parametrize(
    "read",
    [
        frame(b"x" * 10, first=0x81),  # text (autobahn checks its UTF-8)
        frame(b"x" * 10, first=0x02),  # not final: a fragment
        frame(b"x" * 10, first=0x80),  # a continuation
        frame(b"x" * 10, first=0xC2),  # RSV1: compressed, or a protocol violation
        frame(b"x" * 10, first=0xA2),  # RSV2
        frame(b"x" * 10, first=0x92),  # RSV3
        frame(b"x" * 10, first=0x83),  # a reserved data opcode
        frame(b"x" * 10, first=0x09),  # a fragmented ping: autobahn fails it
        frame(b"", first=0x89),  # an empty ping
        frame(b"x" * 10, first=0x89, long_form=True),  # a control frame with a 126 length
        frame(b"x" * 10, first=0x8A),  # pong
        frame(b"\x03\xe8", first=0x88),  # close
        frame(b"x" * 10, masked=False),  # unmasked: autobahn fails it
        frame(b"x" * 10, long_form=True),  # not the minimal length encoding
        frame(b"x" * (LEAN_MAX_BYTES + 1)),  # larger than read lean
        frame(b"x" * 70000),  # an 8-byte length
        frame(b""),  # empty
        frame(b"x" * 10) + frame(b"y" * 10),  # two frames in one read
        frame(b"x" * 10)[:-1],  # part of a frame
        frame(b"x" * 300)[:3],  # part of a header
        frame(b"x" * 10) + b"\x82",  # a frame and the start of the next
        b"",
    ],
)
def test_any_other_read_is_left_to_autobahn(read):
    assert one_lean_frame(read) is None


def test_a_frame_over_the_size_limits_is_left_to_autobahn():
    read = frame(b"x" * 300)
    assert one_lean_frame(read, max_frame=300, max_message=300) is not None
    assert one_lean_frame(read, max_frame=299) is None  # autobahn closes it (1009)
    assert one_lean_frame(read, max_message=299) is None
    assert one_lean_frame(read, max_frame=0, max_message=0) is not None  # 0: no limit
