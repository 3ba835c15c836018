"""Batched frames (docs/agent-protocol.md, "Batched frames"): the codec that joins
encoded frames into a ``batch`` frame, the bounds every batch keeps, the server's check of
an agent's batch, and the agent's side — frames ready in one loop turn go in one batch,
and outcomes in a batch whose socket drops before the acks are reported again."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import msgpack
import pytest

from agents.protocol import batching, frames, wire, work
from agents.runtime import connection
from agents.runtime.client import AgentClient
from agents.runtime.connection import Session
from agents.runtime.outcome_reporter import HeldTask, OutcomeReporter
from agents.surface import consumers
from tests.support.loop import run_async

FORMATS = ("json", "msgpack")
TASK = "00000000-0000-0000-0000-00000000000{}"


def _received(outbox_id: int, fmt: str) -> str | bytes:
    return wire.encode(frames.received(outbox_id), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("count", [2, 15, 16, 17, 300, 65_535, 65_536])
def test_joined_frames_decode_as_a_batch_of_the_same_frames_in_order(fmt, count):
    encoded = [_received(i + 1, fmt) for i in range(count)]
    batch = wire.decode(wire.join_frames(encoded, fmt), fmt)
    assert batch == {"type": "batch", "frames": [frames.received(i + 1) for i in range(count)]}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_frame_that_passes_alone_passes_batched_however_deep(fmt):
    deep: dict = {}
    inner = deep
    for _ in range(wire.MAX_DEPTH - 2):  # "output" and the frame itself take two levels
        inner["x"] = {}
        inner = inner["x"]
    result = {"type": "result", "outbox_id": 1, "output": deep}
    alone = wire.encode(result, fmt)
    assert wire.decode(alone, fmt) == result
    batch = wire.decode(wire.join_frames([alone, alone], fmt), fmt)
    assert batch["frames"] == [result, result]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_batch_holding_something_that_is_not_an_object_is_refused(fmt):
    raw = {"type": "batch", "frames": [frames.received(1), 7]}
    data = msgpack.packb(raw) if fmt == "msgpack" else json.dumps(raw)
    with pytest.raises(wire.WireFormatError, match=r"frames\[1\]"):
        wire.decode(data, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_sends_frames_alone_when_batching_is_off_or_a_frame_has_no_company(fmt):
    one = [_received(1, fmt)]
    two = [_received(1, fmt), _received(2, fmt)]
    assert batching.pack(one, fmt, batch=True) == one  # byte for byte as before
    assert batching.pack(two, fmt, batch=False) == two


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_bounds_each_batch_by_frames_and_bytes_and_keeps_the_order(fmt):
    encoded = [_received(i + 1, fmt) for i in range(10)]
    by_count = batching.pack(encoded, fmt, batch=True, max_frames=4)
    assert [len(wire.decode(b, fmt)["frames"]) for b in by_count[:2]] == [4, 4]
    assert [f["outbox_id"] for b in by_count for f in _frames(b, fmt)] == list(range(1, 11))
    size = batching.frame_bytes(encoded[0])
    by_bytes = batching.pack(
        encoded, fmt, batch=True, max_bytes=wire.BATCH_OVERHEAD_BYTES + 3 * (size + 1)
    )
    assert all(
        batching.frame_bytes(b) <= wire.BATCH_OVERHEAD_BYTES + 3 * (size + 1) for b in by_bytes
    )
    assert [len(_frames(b, fmt)) for b in by_bytes] == [3, 3, 3, 1]
    assert [f["outbox_id"] for b in by_bytes for f in _frames(b, fmt)] == list(range(1, 11))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_frame_too_large_to_share_a_batch_goes_alone(fmt):
    big = wire.encode({"type": "result", "outbox_id": 2, "output": {"s": "x" * 500}}, fmt)
    encoded = [_received(1, fmt), big, _received(3, fmt)]
    packed = batching.pack(encoded, fmt, batch=True, max_bytes=200)
    assert packed == encoded


def _frames(data: str | bytes, fmt: str) -> list[dict]:
    frame = wire.decode(data, fmt)
    return frame["frames"] if frame["type"] == "batch" else [frame]


def test_frame_bytes_counts_text_as_utf8():
    assert batching.frame_bytes("é") == 2 and batching.frame_bytes("e") == 1
    assert batching.frame_bytes(b"abc") == 3


# -- the server's check of an agent's batch --------------------------------------------


def test_the_server_checks_each_frame_of_a_batch_as_it_would_alone():
    result = {"type": "result", "outbox_id": 4, "task_execution_id": TASK.format(1),
              "assignment": 1, "outcome": "success", "output": {}}  # fmt: skip
    checked = consumers._check_batch(
        {"type": "batch", "frames": [frames.received(3), result, {**result, "outcome": "great"}]}
    )
    assert checked[0] == frames.received(3)
    assert checked[1]["type"] == "result" and checked[1]["body"].outbox_id == 4
    assert checked[2]["invalid"] and checked[2]["outbox_id"] == 4  # answered 422, not closed


@pytest.mark.parametrize(
    "inner, why",
    [
        ([], "1..256"),
        ([frames.received(1)] * (frames.MAX_BATCH_FRAMES + 1), "1..256"),
        ([{"type": "heartbeat", "in_flight": 0}], "'heartbeat'"),
        ([{"type": "hello", "holding": []}], "'hello'"),
        ([{"type": "batch", "frames": [frames.received(1)]}], "'batch'"),
        ([{"type": "log"}], "'log'"),
        ([frames.received(1), {"type": "received", "outbox_id": 0}], "outbox_id"),
        ([{"type": "result", "outcome": "success"}], "outbox_id must be an integer"),
    ],
)
def test_a_batch_out_of_bounds_or_carrying_other_frames_is_malformed(inner, why):
    with pytest.raises(consumers.FrameRejected, match=why):
        consumers._check_batch({"type": "batch", "frames": inner})
    with pytest.raises(consumers.FrameRejected):
        consumers._check_batch({"type": "batch", "frames": "not a list"})


def test_the_hello_says_whether_the_agent_takes_batches():
    assert consumers._check_frame(frames.hello([], batch_frames=True))["batch_frames"] is True
    assert consumers._check_frame(frames.hello([]))["batch_frames"] is False
    assert "batch_frames" not in frames.hello([])  # an old agent's hello, byte for byte


# -- the agent's side -------------------------------------------------------------------


class _Socket:
    """A delivery socket's client end: records what is written; ``fail`` makes it drop."""

    def __init__(self, fail: bool = False) -> None:
        self.sent: list[str | bytes] = []
        self.fail = fail

    async def send(self, data: str | bytes) -> None:
        if self.fail:
            raise OSError("connection reset")
        self.sent.append(data)


def test_frames_queued_in_one_loop_turn_go_in_one_batch_frame():
    async def scenario() -> tuple[list, list]:
        batched, plain = _Socket(), _Socket()
        for ws, batch in ((batched, True), (plain, False)):
            session = Session(ws, "json", batch_frames=batch)  # type: ignore[arg-type]
            for outbox_id in (1, 2, 3):
                assert session.send_soon(_received(outbox_id, "json"))
            assert ws.sent == []  # not before the loop turn ends
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            session.send_soon(_received(4, "json"))  # a later turn: alone, unbatched
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        return batched.sent, plain.sent

    batched, plain = run_async(scenario())
    assert [json.loads(f) for f in batched] == [
        {"type": "batch", "frames": [frames.received(1), frames.received(2), frames.received(3)]},
        frames.received(4),
    ]
    assert [json.loads(f) for f in plain] == [frames.received(i) for i in (1, 2, 3, 4)]


def test_a_closed_session_takes_nothing_and_a_failed_write_closes_it():
    async def scenario() -> tuple[bool, bool]:
        session = Session(_Socket(fail=True), "json", batch_frames=True)  # type: ignore[arg-type]
        session.send_soon(_received(1, "json"))
        for _ in range(3):
            await asyncio.sleep(0)
        return session.closed, session.send_soon(_received(2, "json"))

    assert run_async(scenario()) == (True, False)


def test_the_agent_takes_only_work_and_result_acks_from_a_batch():
    work_frame = {"type": "work", "packet": {}}
    ack = {"type": "result_ack", "outbox_id": 1, "status": 200}
    drain = {"type": "drain"}
    assert connection.batched_frames({"type": "batch", "frames": [work_frame, drain, ack]}) == [
        work_frame,
        ack,
    ]
    too_many = {"type": "batch", "frames": [ack] * (frames.MAX_BATCH_FRAMES + 1)}
    assert connection.batched_frames(too_many) == []


PACKET = {
    "task_execution_id": "", "assignment": 1, "function": "m:f", "context_json": "{}",
    "artifact_digest": "a" * 64, "target_triple": "x86_64-unknown-linux-gnu", "timeout_s": 5.0,
}  # fmt: skip


def _held(outbox_id: int) -> HeldTask:
    packet = work.parse_packet(
        {**PACKET, "outbox_id": outbox_id, "task_execution_id": TASK.format(outbox_id)}
    )
    held = HeldTask(packet.key, "agent-1", packet.describe())
    held.result = work.run_result(
        packet, SimpleNamespace(status="success", output={"n": outbox_id})
    )
    return held


def test_outcomes_ready_together_go_in_one_batch_and_are_reported_again_when_the_socket_drops():
    """Three outcomes in one batch frame; the socket drops before any ack: each is reported
    again (here over REST, the next socket being not yet open), and settles only then."""
    posted: list[dict] = []

    def rest(request: httpx.Request) -> httpx.Response:
        posted.append(json.loads(request.content))
        return httpx.Response(200, json={"applied": True, "reason": ""})

    async def scenario() -> tuple[list, list]:
        client = AgentClient("http://server:8000", "the-key", transport=httpx.MockTransport(rest))
        ws = _Socket()
        session = Session(ws, "json", batch_frames=True)  # type: ignore[arg-type]
        settled: list[HeldTask] = []
        current: list[Session | None] = [session]
        reporter = OutcomeReporter(client, settled.append, lambda exc: None, lambda _a: current[0])
        try:
            for outbox_id in (1, 2, 3):
                reporter.submit(_held(outbox_id))
            for _ in range(100):
                if ws.sent:
                    break
                await asyncio.sleep(0)
            assert settled == [] and posted == []
            current[0], session.closed = None, True  # the session ends before any ack
            reporter.socket_closed(session)
            for _ in range(500):
                if len(settled) == 3:
                    break
                await asyncio.sleep(0.01)
        finally:
            await reporter.cancel_all()
            await client.close()
        return ws.sent, settled

    sent, settled = run_async(scenario())
    assert len(sent) == 1
    batch = json.loads(sent[0])
    assert batch["type"] == "batch"
    assert [(f["type"], f["outbox_id"]) for f in batch["frames"]] == [
        ("result", 1), ("result", 2), ("result", 3)
    ]  # fmt: skip
    assert sorted(body["outbox_id"] for body in posted) == [1, 2, 3]
    assert len(settled) == 3


@pytest.mark.parametrize("announced, expected", [({"batch_frames": True}, True), ({}, False)])
def test_the_agent_batches_only_to_a_server_whose_registration_says_so(announced, expected):
    answer = {"agent_id": "a1", "name": "w", "wire_format": "json", **announced}

    async def scenario() -> bool:
        transport = httpx.MockTransport(lambda request: httpx.Response(201, json=answer))
        client = AgentClient("http://server:8000", "the-key", transport=transport)
        try:
            registration = await client.register({"name": "w", "wire_format": "json"})
        finally:
            await client.close()
        return registration.batch_frames

    assert run_async(scenario()) is expected
