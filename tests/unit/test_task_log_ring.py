"""The bounded ring a task's output is kept in (agents/sandbox/task_log.py)."""

from __future__ import annotations

import asyncio

import pytest

from agents.sandbox.task_log import (
    DEFAULT_TASK_LOG_BYTES,
    LiveTail,
    LogChunk,
    LogRing,
    TaskLog,
    follow,
    task_log_bytes,
    truncation_marker,
)
from tests.support.loop import in_own_loop


def test_it_keeps_everything_below_its_capacity():
    ring = LogRing(64)
    ring.append(b"hello\n")
    ring.append(b"world\n")
    log = ring.snapshot()
    assert log == TaskLog("hello\nworld\n", 12, 0)
    assert not log.truncated
    assert log.render() == "hello\nworld\n"


def test_it_keeps_only_the_last_bytes_and_marks_the_truncation():
    ring = LogRing(10)
    for i in range(10):
        ring.append(f"line {i}\n".encode())  # 7 bytes each, 70 in all
    log = ring.snapshot()
    assert (log.text, log.bytes, log.truncated_bytes) == (" 8\nline 9\n", 70, 60)
    assert log.render() == "[… 60 bytes truncated …]\n 8\nline 9\n"
    assert log.render().startswith(truncation_marker(60))


def test_one_write_larger_than_the_ring_keeps_its_tail():
    ring = LogRing(8)
    ring.append(b"x" * 100 + b"ABCDEFGH")
    assert ring.snapshot() == TaskLog("ABCDEFGH", 108, 100)
    assert ring.written == 108 and ring.dropped == 100


def test_memory_never_grows_past_the_capacity():
    ring = LogRing(1000)
    for _ in range(5000):
        ring.append(b"y" * 333)
    log = ring.snapshot()
    assert len(log.text) == 1000
    assert log.bytes == 5000 * 333


def test_a_character_cut_by_the_truncation_is_dropped_not_garbled():
    ring = LogRing(4)
    ring.append("aé€".encode())  # 1 + 2 + 3 bytes: the cut falls inside "é"
    log = ring.snapshot()
    assert log.text == "€"
    assert log.truncated_bytes == 2


def test_undecodable_bytes_and_nul_are_replaced():
    ring = LogRing(64)
    ring.append(b"ok \xff\xfe\x00\n")
    assert ring.snapshot().text == "ok \ufffd\ufffd\ufffd\n"
    assert ring.since(0).text == "ok \ufffd\ufffd\ufffd\n"


def test_since_returns_only_new_output_and_counts_what_was_dropped_meanwhile():
    ring = LogRing(8)
    assert ring.since(0) is None
    ring.append(b"abc")
    first = ring.since(0)
    assert (first.text, first.end, first.skipped) == ("abc", 3, 0)
    assert ring.since(first.end) is None
    ring.append(b"defghijklm")  # 13 written, the ring keeps "fghijklm"
    second = ring.since(first.end)
    assert (second.text, second.end, second.skipped) == ("fghijklm", 13, 2)


def test_since_holds_back_a_character_not_yet_complete():
    ring = LogRing(64)
    euro = "€".encode()
    ring.append(b"x" + euro[:2])
    chunk = ring.since(0)
    assert (chunk.text, chunk.end) == ("x", 1)
    ring.append(euro[2:])
    rest = ring.since(chunk.end)
    assert (rest.text, rest.end) == ("€", 4)


def test_the_capacity_comes_from_the_environment():
    assert task_log_bytes({}) == DEFAULT_TASK_LOG_BYTES == 262144
    assert task_log_bytes({"CLOACINA_TASK_LOG_BYTES": "4096"}) == 4096
    with pytest.raises(ValueError, match="CLOACINA_TASK_LOG_BYTES must be an integer"):
        task_log_bytes({"CLOACINA_TASK_LOG_BYTES": "lots"})
    with pytest.raises(ValueError, match="at least 1024"):
        task_log_bytes({"CLOACINA_TASK_LOG_BYTES": "10"})


def test_the_outcome_body_names_text_bytes_and_truncation():
    assert TaskLog("t", 9, 8).as_body() == {"text": "t", "bytes": 9, "truncated_bytes": 8}


def test_since_caps_a_chunk_to_its_last_bytes():
    ring = LogRing(64)
    ring.append(b"0123456789")
    chunk = ring.since(2, max_bytes=4)
    assert (chunk.text, chunk.end, chunk.skipped) == ("6789", 10, 4)


@in_own_loop
async def test_follow_ships_new_output_until_cancelled():
    ring = LogRing(64)
    shipped: list[LogChunk] = []

    async def ship(chunk: LogChunk) -> None:
        shipped.append(chunk)

    tail = asyncio.ensure_future(follow(ring, ship, interval_s=0.001))
    ring.append(b"one\n")
    while not shipped:
        await asyncio.sleep(0.001)
    ring.append(b"two\n")
    while len(shipped) < 2:
        await asyncio.sleep(0.001)
    tail.cancel()
    assert [(c.text, c.end) for c in shipped] == [("one\n", 4), ("two\n", 8)]


@in_own_loop
async def test_follow_survives_a_chunk_that_fails_to_ship():
    ring = LogRing(64)
    calls: list[str] = []

    async def ship(chunk: LogChunk) -> None:
        calls.append(chunk.text)
        if len(calls) == 1:
            raise ConnectionError("socket gone")

    tail = asyncio.ensure_future(follow(ring, ship, interval_s=0.001))
    ring.append(b"lost\n")
    while not calls:
        await asyncio.sleep(0.001)
    ring.append(b"next\n")
    while len(calls) < 2:
        await asyncio.sleep(0.001)
    tail.cancel()
    assert calls == ["lost\n", "next\n"]


@in_own_loop
async def test_a_live_tail_of_a_short_run_starts_no_task():
    ring = LogRing(64)
    shipped: list[LogChunk] = []

    async def ship(chunk: LogChunk) -> None:
        shipped.append(chunk)

    before = len(asyncio.all_tasks())
    tail = LiveTail(ring, ship, interval_s=0.05)
    ring.append(b"quick\n")
    assert len(asyncio.all_tasks()) == before  # a timer, not a task
    tail.stop()
    await asyncio.sleep(0.1)
    assert shipped == [] and len(asyncio.all_tasks()) == before


@in_own_loop
async def test_a_live_tail_ships_from_its_interval_on_until_stopped():
    ring = LogRing(64)
    shipped: list[tuple[LogChunk, float]] = []
    loop = asyncio.get_running_loop()

    async def ship(chunk: LogChunk) -> None:
        shipped.append((chunk, loop.time()))

    started = loop.time()
    tail = LiveTail(ring, ship, interval_s=0.05)
    ring.append(b"one\n")
    while not shipped:
        await asyncio.sleep(0.005)
    ring.append(b"two\n")
    while len(shipped) < 2:
        await asyncio.sleep(0.005)
    tail.stop()
    ring.append(b"three\n")
    await asyncio.sleep(0.15)
    assert [(c.text, c.end) for c, _ in shipped] == [("one\n", 4), ("two\n", 8)]
    assert shipped[0][1] - started >= 0.05  # not before its interval
    assert shipped[1][1] - shipped[0][1] >= 0.05
