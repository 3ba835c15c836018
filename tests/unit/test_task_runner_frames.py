"""The task runner's framing of a child's replies: whole frames out of whatever the reads gave.

A child writes a small reply as one write, so the parent takes it with one read; a large one
arrives over several reads, and bytes past a frame stay for the next.  The child reads its
requests the same way (docs/performance.md, "Round i17-agent (session 16)").
"""

from __future__ import annotations

import os
import socket
import struct
import threading

import pytest

from agents.sandbox import task_child
from agents.sandbox.task_child import take_frame
from agents.sandbox.task_runner import encode_frame


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


class _CountingReads:
    """``os.read`` as the child calls it, counted."""

    def __init__(self) -> None:
        self.calls = 0
        self.read = os.read  # the real one: the module is patched, not a name in it

    def __call__(self, fd: int, n: int) -> bytes:
        self.calls += 1
        return self.read(fd, n)


def _child_requests(monkeypatch) -> tuple[socket.socket, task_child._Requests, _CountingReads]:
    parent, child = socket.socketpair()
    reads = _CountingReads()
    monkeypatch.setattr(task_child.os, "read", reads)
    return parent, task_child._Requests(child.detach()), reads


def test_the_child_takes_a_small_request_in_one_read(monkeypatch):
    """Header and body in one read, not two (``Connection.recv_bytes`` read the header,
    then the body): one system call fewer per task in every child."""
    parent, requests, reads = _child_requests(monkeypatch)
    for n in range(3):
        parent.sendall(encode_frame(b'{"op":"run","n":%d}' % n))
        assert requests.next() == b'{"op":"run","n":%d}' % n
    assert reads.calls == 3


def test_the_child_reassembles_requests_split_or_joined_by_the_socket(monkeypatch):
    parent, requests, _ = _child_requests(monkeypatch)
    large = b"y" * (3 * task_child.REQUEST_READ_BYTES + 5)  # several reads
    parent.sendall(encode_frame(b"one") + encode_frame(b"") + struct.pack("!iQ", -1, 3) + b"two")
    assert [requests.next(), requests.next(), requests.next()] == [b"one", b"", b"two"]
    sender = threading.Thread(target=parent.sendall, args=(encode_frame(large),))
    sender.start()
    assert requests.next() == large
    sender.join()
    parent.close()
    with pytest.raises(EOFError):
        requests.next()
