"""agents/protocol/heap.py, SurvivorFreezer: a full collection's survivors are frozen, and
what they leave behind as cyclic garbage is freed at the next thaw — nothing leaks over
connect/disconnect churn."""

from __future__ import annotations

import gc
import weakref

import pytest

from agents.protocol.heap import SurvivorFreezer
from tests.support.clock import ManualClock


class FakeSocket:
    """What a connection keeps alive, in cycles: a protocol and its transport refer to each
    other, and its buffer is a container too."""

    def __init__(self) -> None:
        self.transport = {"protocol": self, "buffer": [bytearray(64)]}


@pytest.fixture
def freezer():
    gc.collect()
    clock = ManualClock()
    freezer = SurvivorFreezer(thaw_every_s=60.0, clock=clock)
    freezer.install()
    try:
        yield freezer, clock
    finally:
        freezer.uninstall()
        gc.unfreeze()
        gc.collect()


def test_the_survivors_of_a_full_collection_are_frozen_and_its_garbage_is_freed(freezer) -> None:
    kept = FakeSocket()
    garbage = FakeSocket()
    gone = weakref.ref(garbage)
    del garbage
    gc.collect()
    assert gone() is None
    assert gc.get_freeze_count() > 0
    # The next full collection does not walk it again.
    assert not any(obj is kept for obj in gc.get_objects(generation=2))


def test_a_younger_collection_freezes_nothing(freezer) -> None:
    gc.collect()
    frozen = gc.get_freeze_count()
    young = [FakeSocket() for _ in range(10)]
    gc.collect(0)
    gc.collect(1)
    assert gc.get_freeze_count() == frozen
    del young


def test_frozen_cyclic_garbage_is_freed_at_the_first_full_collection_after_the_thaw_interval(
    freezer,
) -> None:
    freezer_, clock = freezer
    socket = FakeSocket()
    gc.collect()  # frozen with the survivors
    closed = weakref.ref(socket)
    del socket  # a closed connection: its cycle is garbage now
    gc.collect()
    assert closed() is not None  # frozen: not walked before the thaw is due
    clock.now += 60.0
    gc.collect()
    assert closed() is None
    assert freezer_.thaws == 1


def test_connect_disconnect_churn_does_not_leak(freezer) -> None:
    _, clock = freezer
    alive: list[FakeSocket] = []
    closed: list[weakref.ref] = []
    for _ in range(40):
        alive += [FakeSocket() for _ in range(50)]  # a storm of connects
        gc.collect()  # a full collection during it freezes them
        closed += [weakref.ref(socket) for socket in alive[:40]]  # most disconnect again
        del alive[:40]
        clock.now += 5.0  # a thaw is due every 12 rounds
    frozen_during = gc.get_freeze_count()
    clock.now += 60.0
    gc.collect()
    assert all(ref() is None for ref in closed)  # every closed socket freed
    assert len(alive) == 40 * 10
    # What stays frozen is what is alive, not what churned through.
    assert gc.get_freeze_count() <= frozen_during
