"""The lean frame reader on a real autobahn server protocol (cloacina_site/daphne_limits.py,
``_lean_frames``): for every sequence of reads, a socket with it hands the application the
same messages, writes the same bytes back (pongs, close frames and their codes), ends in the
same state and counts the same traffic as autobahn's own parser.  Integration: autobahn's
Twisted protocol needs Twisted."""

from __future__ import annotations

import base64

import pytest
from autobahn.twisted.websocket import WebSocketServerFactory, WebSocketServerProtocol
from autobahn.websocket.xormasker import create_xor_masker
from twisted.internet.testing import StringTransport

from cloacina_site import daphne_limits

MAX_FRAME = 2000
BYE = b"the application closes on this"


class Transport(StringTransport):
    def unregisterProducer(self) -> None:  # autobahn unregisters on a failed connection
        self.producer = None


class Recording(WebSocketServerProtocol):
    """autobahn's server protocol, recording the messages it hands the application."""

    frame_shortcut = staticmethod(lambda payload, binary: False)  # as a delivery socket's

    def onMessage(self, payload, isBinary):
        self.got.append((payload, isBinary))
        if payload == BYE:  # the application closes the socket on this message
            self.sendClose(code=1000)


class Lean(Recording):
    pass


daphne_limits._lean_frames(Lean)


def opened(protocol_class) -> tuple[WebSocketServerProtocol, Transport]:
    factory = WebSocketServerFactory("ws://localhost:9000")
    factory.protocol = protocol_class
    factory.setProtocolOptions(maxFramePayloadSize=MAX_FRAME, maxMessagePayloadSize=MAX_FRAME)
    protocol = factory.buildProtocol(None)
    protocol.got = []
    transport = Transport()
    protocol.makeConnection(transport)
    key = base64.b64encode(b"0123456789abcdef").decode()
    protocol.dataReceived(
        "GET / HTTP/1.1\r\nHost: localhost:9000\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    assert protocol.state == protocol.STATE_OPEN
    transport.clear()
    return protocol, transport


def frame(payload: bytes, first: int = 0x82, long_form: bool = False) -> bytes:
    size = len(payload)
    if size < 126 and not long_form:
        header = bytes([first, 0x80 | size])
    else:
        header = bytes([first, 0x80 | 126]) + size.to_bytes(2, "big")
    mask = b"\x37\xfa\x21\x3d"
    return header + mask + create_xor_masker(mask, size).process(payload)


BEAT = frame(bytes(range(256)) + b"heartbeat" * 3)
READS = {
    "one beat": [BEAT],
    "beats in turn": [BEAT, frame(b"b" * 3), frame(b"c" * 126), BEAT],
    "two frames in a read": [BEAT + frame(b"two")],
    "a frame over two reads": [BEAT[:5], BEAT[5:], BEAT],
    "a header over two reads": [BEAT[:1], BEAT[1:]],
    "text": [frame(b'{"type": "heartbeat"}', 0x81), BEAT],
    "invalid UTF-8 text": [frame(b"\xff\xfe", 0x81)],
    "a ping, then a beat": [frame(b"ping", 0x89), BEAT],
    "a ping and a beat in a read": [frame(b"ping", 0x89) + BEAT],
    "pings in turn": [frame(b"p1", 0x89), frame(b"x" * 125, 0x89), BEAT, frame(b"p3", 0x89)],
    "an empty ping": [frame(b"", 0x89), BEAT],
    "a pong": [frame(b"pong", 0x8A), BEAT],
    "fragments": [frame(b"part one", 0x02), frame(b"part two", 0x80), BEAT],
    "a beat inside a fragmented message": [frame(b"part", 0x02), BEAT],
    "compressed without the extension": [frame(b"x" * 10, 0xC2)],
    "a reserved opcode": [frame(b"x", 0x83)],
    "not the minimal length": [frame(b"x" * 10, long_form=True)],
    "unmasked": [bytes([0x82, 3]) + b"abc"],
    "over the frame limit": [frame(b"x" * (MAX_FRAME + 1))],
    "empty": [frame(b""), BEAT],
    "a close, then a beat": [frame(b"\x03\xe8bye", 0x88), BEAT],
    "three beats in a read": [BEAT + frame(b"two") + frame(b"c" * 126)],
    "a beat, a ping and a beat in a read": [BEAT + frame(b"ping", 0x89) + BEAT],
    "beats in a read, then the start of the next": [BEAT + BEAT[:9], BEAT[9:]],
    "a beat and a text frame in a read": [BEAT + frame(b'{"a": 1}', 0x81)],
    "a beat and a close in a read": [BEAT + frame(b"\x03\xe8bye", 0x88), BEAT],
    "a beat and an oversized frame in a read": [BEAT + frame(b"x" * (MAX_FRAME + 1))],
    "a message the application closes on, then beats, in a read": [
        frame(BYE) + BEAT + frame(b"ping", 0x89) + BEAT
    ],
}


@pytest.mark.parametrize("reads", READS.values(), ids=READS.keys())
def test_the_lean_reader_does_what_autobahn_does(reads):
    usual, usual_out = opened(Recording)
    lean, lean_out = opened(Lean)
    for read in reads:
        usual.dataReceived(read)
        lean.dataReceived(read)
    assert lean.got == usual.got
    assert lean_out.value() == usual_out.value()  # pongs, close frames and their codes
    assert lean.state == usual.state
    assert lean.wasClean == usual.wasClean
    assert lean.trafficStats.__json__() == usual.trafficStats.__json__()


def test_a_socket_without_the_frame_shortcut_is_read_by_autobahn(monkeypatch):
    lean, _ = opened(Lean)
    lean.frame_shortcut = None  # before its consumer took the shortcut (or not a delivery socket)
    monkeypatch.setattr(daphne_limits, "one_lean_frame", pytest.fail)
    monkeypatch.setattr(daphne_limits, "lean_frames", pytest.fail)
    lean.dataReceived(BEAT)
    assert len(lean.got) == 1


def test_a_lone_binary_frame_or_ping_skips_autobahns_parser(monkeypatch):
    lean, _ = opened(Lean)
    monkeypatch.setattr(Lean, "processData", pytest.fail, raising=False)
    lean.dataReceived(BEAT)
    lean.dataReceived(frame(b"ping", 0x89))
    lean.dataReceived(BEAT)
    assert len(lean.got) == 2 and lean.got[0] == lean.got[1]


def test_complete_frames_in_one_read_skip_autobahns_parser(monkeypatch):
    # Under load an agent's `received`, its result and a beat arrive in one read.
    lean, _ = opened(Lean)
    monkeypatch.setattr(Lean, "processData", pytest.fail, raising=False)
    lean.dataReceived(BEAT + frame(b"ping", 0x89) + frame(b"two") + BEAT)
    beat = lean.got[0][0]
    assert [payload for payload, _ in lean.got] == [beat, b"two", beat]
    assert lean.trafficStats.incomingWebSocketMessages == 3
