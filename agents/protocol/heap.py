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
