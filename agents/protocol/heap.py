"""Keep the objects a process loaded at startup out of its garbage collections.

A full (generation 2) collection walks every tracked object.  Django, the ORM's models,
daphne and the agent's libraries leave a few hundred thousand of them behind at startup,
and none of them ever becomes garbage, so each full collection spent most of its time
re-proving that: one took 160 ms on the server and 280 ms on an agent (loaded 2-core
machine, ``fleetbench --pickup-hops``), stopping the process's every thread in the middle
of whatever task it was handing on — an idle pickup's p99.  Frozen objects
(:func:`gc.freeze`) are skipped by every later collection; the server and ``runagent``
freeze theirs once they are ready.  Both run on the server and on agents, so this lives
with the Django-free libraries the two share.
"""

from __future__ import annotations

import gc
import time


def freeze_startup_heap() -> int:
    """Collect once, then move every surviving object to the permanent generation (garbage
    frozen would never be freed).  Returns how many objects are frozen now."""
    was_enabled = gc.isenabled()
    gc.disable()  # no automatic collection starts in another thread in between
    try:
        _collect_fully()
        gc.freeze()
    finally:
        if was_enabled:
            gc.enable()
    return gc.get_freeze_count()


def _collect_fully(attempts: int = 100) -> None:
    """A full collection that really ran: ``gc.collect()`` returns at once, collecting
    nothing, while another thread's collection is in progress (it may be running
    finalizers with the GIL released), and its garbage would then be frozen for ever."""
    for _ in range(attempts):
        before = gc.get_stats()[2]["collections"]
        gc.collect()
        if gc.get_stats()[2]["collections"] > before:
            return
        time.sleep(0.001)  # let the other thread's collection finish


# How often at most the frozen objects are handed back to the collector (see SurvivorFreezer).
THAW_EVERY_S = 60.0


class SurvivorFreezer:
    """After each full collection, freeze what survived it; once in a while, thaw first.

    While thousands of sockets connect the heap grows, and each full collection walked every
    socket's objects again (the consumer, the protocol, the transport, their buffers): the
    more sockets, the longer and the more frequent the walks.  Frozen right after a full
    collection, those objects are walked once: the next full collection sees only what was
    promoted since.  Only survivors are frozen (the collection just freed the cyclic garbage),
    but a frozen object that later becomes cyclic garbage — a closed socket's cycle — is
    freed only once thawed: so the first full collection at least ``thaw_every_s`` after the
    last thaw unfreezes everything first (:func:`gc.unfreeze`, in the collection's ``start``
    callback), collects the whole heap, and freezes its survivors again.  Garbage freed by
    reference counting is freed at once, frozen or not.
    """

    def __init__(self, thaw_every_s: float = THAW_EVERY_S, clock=time.monotonic) -> None:
        self.thaw_every_s = thaw_every_s
        self._clock = clock
        self._last_thaw = clock()
        self.thaws = 0

    def install(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            if self._clock() - self._last_thaw >= self.thaw_every_s:
                gc.unfreeze()  # this collection walks the whole heap again
                self._last_thaw = self._clock()
                self.thaws += 1
        else:
            gc.freeze()  # the survivors of the collection that just ended
