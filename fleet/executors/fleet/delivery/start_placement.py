"""The REST start places its lone root task in its own transaction (issue 17, idle pickup).

An idle pickup used to be two synchronous hand-offs in series: the start's commit, then the
dispatch loop's placement (:mod:`fleet.executors.fleet.delivery.one_trip`: a round trip and a
commit of its own on the loop's connection) and the hop back to the loop.  While the fleet
executor runs in this process, :class:`StartPlacer` is the engine's start hook
(:mod:`fleet.engine.hooks`): ``scheduler.start_active`` sends one_trip's statement for the
execution's lone root (:data:`~fleet.executors.fleet.delivery.one_trip.START_STATEMENT`,
the task found by its execution's id) after its insert, in the same transaction and the
same flight, so one synchronous commit covers the start, the claim, the slot and the
outbox row (written ``delivered``).  The placement rides on the root's event; the dispatch
loop hands it to the executor at once, which registers the waiter and pushes the packet.

What the statement takes is one_trip's (plain lone root, python package, a context it can
encode, …), and only onto an agent whose socket THIS process holds (the packet is pushed
from here).  Anything else, or no free slot, writes nothing and the root goes the usual way.

Only one start at a time places here: such a start holds its tenant's agent rows from the
placement to its synchronous commit, so concurrent starts (a burst) would queue on them
behind each other's fsync; while one places, the others' roots go the usual way (batched).

A crash after the commit and before the push leaves a delivered, unconfirmed outbox row:
redelivery (:mod:`fleet.executors.fleet.delivery.redelivery`) pushes it again, and the
agent's hello and the reclaim of a dead server's agents cover the rest, as for any
placement the batch path wrote delivered (tests/integration/test_fleet_start_placement.py).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import replace

from agents.protocol import hop_trace
from fleet.engine.hooks import StartHook, StartPlacement
from fleet.executors.fleet.delivery import local_sockets, one_trip
from fleet.executors.fleet.delivery.placement import Delivered
from fleet.executors.fleet.routing.metrics import SELECTION_SUCCESS
from fleet.executors.fleet.routing.selectors import UNCONSTRAINED


class StartPlacer(StartHook):
    """The fleet executor's start hook (registered by ``FleetExecutor.start``)."""

    def __init__(self, claimer: str, has_room: Callable[[], bool]) -> None:
        """``has_room``: the executor's view of free slots (a hint: the statement decides)."""
        self.claimer = claimer
        self._has_room = has_room
        self._turn = threading.Lock()
        self.placed = 0  # roots placed by their start (tests and measurements read it)

    def placement(self, tenant_id: int, workflow_execution_id: uuid.UUID) -> StartPlacement | None:
        if not tenant_id or not local_sockets.digest()[0] or not self._has_room():
            return None  # nothing this process could push to
        if not self._turn.acquire(blocking=False):
            return None  # another start places now (module docstring)
        return StartPlacement(
            one_trip.START_STATEMENT,
            one_trip.start_params(workflow_execution_id, tenant_id, self.claimer),
            self._answer,
            self._turn.release,
        )

    def _answer(self, row: tuple | None) -> Delivered | None:
        if row is None or row[13] is None or not row[15]:
            return None  # not taken (not eligible, no free local slot): nothing written
        hop_trace.mark("start_placed", row[0])
        SELECTION_SUCCESS.labels(step=UNCONSTRAINED.step).inc()
        self.placed += 1
        placed = one_trip.placed(row)  # local (row[15]): a Delivered, its packet built
        # The statement's now() is the transaction's, a hair before ready_at: not below 0.
        return replace(placed, waited_s=max(0.0, placed.waited_s))
