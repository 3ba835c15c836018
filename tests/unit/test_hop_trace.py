"""The idle pickup's hop trace (agents/protocol/hop_trace.py) and how fleetbench --pickup-hops
reads it (fleet/bench/pickup_hops.py): lines only when on, outbox marks joined to their task,
each hop timed from the mark before it, collections counted per process."""

from __future__ import annotations

import gc
import os

import pytest

from agents.protocol import hop_trace
from fleet.bench import pickup_hops


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "hops.trace"
    hop_trace.trace_to(str(path))
    yield path
    hop_trace.trace_to("")


def test_it_writes_nothing_while_off(tmp_path):
    hop_trace.trace_to("")
    hop_trace.mark("placing", "t1")
    hop_trace.mark_many("claimed", ["t1", "t2"])
    assert not hop_trace.enabled()
    assert list(tmp_path.iterdir()) == []


def test_it_writes_one_line_per_mark_while_on(trace):
    hop_trace.mark("frame_sent", "t1", 7)
    hop_trace.mark("agent_read", outbox=7)
    hop_trace.mark_many("claimed", ["t1", "t2"])
    lines = [line.split(" ") for line in trace.read_text().splitlines()]
    assert [line[1:] for line in lines] == [
        ["frame_sent", "t1", "7"], ["agent_read", "-", "7"], ["claimed", "t1", "-"],
        ["claimed", "t2", "-"],
    ]  # fmt: skip
    assert lines[2][0] == lines[3][0]  # mark_many: one instant for all


def test_it_traces_garbage_collections_with_the_process_id(trace, monkeypatch):
    monkeypatch.setattr(hop_trace, "GC_PAUSE_MIN_S", 0.0)
    gc.collect()
    collections = [line.split(" ") for line in trace.read_text().splitlines()]
    assert ["gc2", str(os.getpid())] in [line[1:3] for line in collections]
    assert pickup_hops.gc_pauses(trace, os.getpid())["server: a gc2 collection ≥ 0.5 ms"]


def test_the_table_joins_outbox_marks_to_their_task_and_times_each_hop(tmp_path):
    trace = tmp_path / "hops.trace"
    trace.write_text(
        "100.000 submitted t1 -\n"
        "100.001 loop_queued t1 -\n"
        "100.004 frame_sent t1 9\n"
        "100.005 agent_read - 9\n"
        "100.006 agent_read - 9\n"  # a repeat push: the first mark counts
        "100.007 gc0 4242 1.500\n"
    )
    marks, outbox_task = pickup_hops.read_trace(trace)
    assert outbox_task == {"9": "t1"}
    assert marks["t1"]["agent_read"] == pytest.approx(100.005)
    hops = pickup_hops.hop_table({"t1": {"ready_at": 99.990, "received_at": 100.010}}, marks)
    assert hops["API: ready_at → its statement committed"] == [pytest.approx(10.0)]
    assert hops["→ event on the dispatch loop"] == [pytest.approx(1.0)]
    assert hops["→ the agent decoded it"] == [pytest.approx(1.0)]
    assert hops["→ a dispatch worker has it"] == []  # no `dispatching` mark: not timed
    assert hops["Ready → received_at (whole path)"] == [pytest.approx(20.0)]
    assert pickup_hops.gc_pauses(trace, 1) == {"agents: a gc0 collection ≥ 0.5 ms": [1.5]}


def test_the_placement_is_one_hop_and_split_only_for_a_two_trip_placement():
    """One trip (on the loop: no ``claimed`` mark) and two trips (a delivery thread) are
    both timed by the placement's hop; only the two-trip one is split at its claim."""
    marks = {
        "one": {"placing": 1.000, "committed": 1.002, "placed_on_loop": 1.003},
        "two": {"placing": 1.000, "claimed": 1.003, "committed": 1.007, "placed_on_loop": 1.008},
    }
    rows = {t: {"ready_at": 0.990, "received_at": 1.010} for t in marks}
    hops = pickup_hops.hop_table(rows, marks)
    placement = hops["→ the placement answered (claim … COMMIT)"]
    assert placement == [pytest.approx(2.0), pytest.approx(7.0)]
    assert hops["  (two trips) BEGIN + claim answered"] == [pytest.approx(3.0)]
    assert hops["  (two trips) reservation + COMMIT answered"] == [pytest.approx(4.0)]
