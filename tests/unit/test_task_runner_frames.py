"""The task runner's framing of a child's replies: whole frames out of whatever the reads gave.

A child writes a small reply as one write, so the parent takes it with one read; a large one
arrives over several reads, and bytes past a frame stay for the next.
"""

from __future__ import annotations

import struct

from agents.sandbox.task_runner import encode_frame, take_frame


def test_a_frame_is_taken_only_once_it_is_whole():
    data = encode_frame(b'{"status":"success"}')
    inbox = bytearray()
    for byte in data[:-1]:
        inbox.append(byte)
        assert take_frame(inbox) is None
    inbox.append(data[-1])
    assert take_frame(inbox) == b'{"status":"success"}'
    assert inbox == bytearray()


def test_bytes_past_a_frame_are_kept_for_the_next():
    inbox = bytearray(encode_frame(b"one") + encode_frame(b"") + encode_frame(b"three")[:5])
    assert take_frame(inbox) == b"one"
    assert take_frame(inbox) == b""
    assert take_frame(inbox) is None
    inbox += encode_frame(b"three")[5:]
    assert take_frame(inbox) == b"three"
    assert not inbox


def test_the_long_header_of_multiprocessing_frames_is_read():
    body = b"x" * 10
    inbox = bytearray(struct.pack("!iQ", -1, len(body)) + body)
    assert take_frame(bytearray(inbox[:11])) is None
    assert take_frame(inbox) == body
