"""agents/protocol/heap.py: what survives startup is frozen; its garbage is not."""

from __future__ import annotations

import gc
import weakref

from agents.protocol.heap import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only a collection frees it


def test_it_freezes_the_survivors_and_collects_the_garbage_first() -> None:
    kept = Node()
    garbage = Node()
    gone = weakref.ref(garbage)
    del garbage
    try:
        frozen = freeze_startup_heap()
        assert frozen > 0 and frozen == gc.get_freeze_count()
        assert gone() is None  # collected before the freeze, not frozen for ever
        # A later full collection skips the frozen objects: it sees only new ones.
        assert not any(obj is kept for obj in gc.get_objects(generation=2))
    finally:
        gc.unfreeze()


def test_a_collection_that_did_not_run_is_tried_again(monkeypatch) -> None:
    # gc.collect() returns at once, collecting nothing, while another thread collects.
    real_collect, calls = gc.collect, []

    def busy_then_real(*args):
        calls.append(args)
        return 0 if len(calls) == 1 else real_collect(*args)

    monkeypatch.setattr(gc, "collect", busy_then_real)
    garbage = Node()
    gone = weakref.ref(garbage)
    del garbage
    try:
        freeze_startup_heap()
        assert len(calls) == 2
        assert gone() is None  # not frozen for ever with the survivors
        assert gc.isenabled()
    finally:
        gc.unfreeze()
