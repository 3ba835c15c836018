"""Where a dispatching FleetExecutor waits for its task's outcome.

A waiter is keyed by task_execution_id and registered before the packet is
enqueued.  Whoever applies the outcome wakes it: the result endpoint of this
process directly (:func:`wake`, thread-safe), any other process through
``NOTIFY task_outcome, '<task id>:<assignment>:<status>'`` (:func:`announce`),
which this process's listener turns into the same call.  Outcomes go to the
database first; the rendezvous only shortens the wait, so a lost wake-up costs
the waiter one database check, never the result.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from dataclasses import dataclass

from django.db import connection

from fleet.engine import loop_inbox
from fleet.engine.events import ExecutionStatus

log = logging.getLogger(__name__)

CHANNEL = "task_outcome"


@dataclass(frozen=True)
class Outcome:
    assignment: int
    status: ExecutionStatus
    reason: str = ""
    # Its place in this process's wake-ups (:attr:`Rendezvous.posted`), set when it is
    # handed to the waiter's loop, after it was committed; 0: not known.
    posted: int = 0


class Rendezvous:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[uuid.UUID, tuple[int, asyncio.Future, asyncio.AbstractEventLoop]] = {}
        # Outcomes handed to a local waiter so far.  Each is numbered when handed over,
        # after its commit: a capacity probe that notes this figure before its query knows
        # the slots of outcomes numbered up to it are free in what it reads
        # (fleet/executors/fleet/capacity_estimate.py).
        self.posted = 0
        # Outcomes whose COMMIT is on its way and which are not handed over yet: a probe
        # that starts meanwhile may read their slots free (see :meth:`mark`).
        self.committing = 0

    def commit_coming(self, outcomes: int) -> int:
        """A batch of ``outcomes`` sends its COMMIT now; :meth:`commit_done` when they
        were handed over (or failed).  Returns ``outcomes``."""
        with self._lock:
            self.committing += outcomes
        return outcomes

    def commit_done(self, outcomes: int) -> None:
        with self._lock:
            self.committing -= outcomes

    def mark(self) -> int:
        """For a capacity probe, before its query: outcomes numbered up to this may be free
        in what it reads.  Those handed over already were committed before; those of a
        batch whose COMMIT went out before it most likely were, and a batch hands its own
        over in a row, so they take the next numbers.  A slot counted as seen that the
        probe did not read is seen by the next probe (0.1 s); one counted twice sent
        placements to a slot that was not there."""
        with self._lock:
            return self.posted + self.committing

    def register(self, task_execution_id: uuid.UUID, assignment: int = 0) -> asyncio.Future:
        """A future resolved with an :class:`Outcome` for ``task_execution_id`` (call on the event loop).

        ``assignment`` 0 accepts any assignment (it is set once the claim is known).
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._waiters[task_execution_id] = (assignment, future, loop)
        return future

    def set_assignment(self, task_execution_id: uuid.UUID, assignment: int) -> None:
        with self._lock:
            entry = self._waiters.get(task_execution_id)
            if entry is not None:
                self._waiters[task_execution_id] = (assignment, entry[1], entry[2])

    def unregister(self, task_execution_id: uuid.UUID, future: asyncio.Future) -> None:
        with self._lock:
            entry = self._waiters.get(task_execution_id)
            if entry is not None and entry[1] is future:
                del self._waiters[task_execution_id]

    def waiting(self) -> int:
        with self._lock:
            return len(self._waiters)

    def wake(self, task_execution_id: uuid.UUID, outcome: Outcome) -> bool:
        """Resolve the local waiter of ``task_execution_id`` (any thread); False if none is here."""
        with self._lock:
            entry = self._waiters.get(task_execution_id)
        if entry is None:
            return False
        assignment, future, loop = entry
        if assignment and assignment != outcome.assignment:
            return False
        with self._lock:
            self.posted += 1
            outcome = _numbered(outcome, self.posted)
        return loop_inbox.inbox(loop).post(_resolve, future, outcome)  # False: loop closed

    def wake_all_to_recheck(self) -> None:
        """Wake every waiter with no outcome: after a listener reconnect, notifications
        may have been lost, so each waiter re-reads its task from the database."""
        with self._lock:
            entries = list(self._waiters.values())
        for _assignment, future, loop in entries:
            try:
                loop.call_soon_threadsafe(_resolve, future, None)
            except RuntimeError:
                pass

    def on_notify(self, payload: str) -> None:
        """Listener callback for ``task_outcome`` notifications."""
        try:
            task_text, assignment, status = payload.split(":", 2)
            outcome = Outcome(int(assignment), ExecutionStatus(status))
            task_execution_id = uuid.UUID(task_text)
        except ValueError:
            log.warning("ignoring malformed task_outcome notification %r", payload)
            return
        self.wake(task_execution_id, outcome)

    def wake_many(
        self, outcomes: list[tuple[uuid.UUID, Outcome]]
    ) -> list[tuple[uuid.UUID, Outcome]]:
        """Resolve the local waiters of many tasks with one hop per event loop (any thread);
        return the outcomes whose waiter is not here."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        elsewhere = []
        with self._lock:
            for task_execution_id, outcome in outcomes:
                entry = self._waiters.get(task_execution_id)
                if entry is None or (entry[0] and entry[0] != outcome.assignment):
                    elsewhere.append((task_execution_id, outcome))
                    continue
                self.posted += 1
                by_loop.setdefault(entry[2], []).append((entry[1], _numbered(outcome, self.posted)))
        for loop, resolutions in by_loop.items():
            # Through the loop's inbox: with the batch's own answer and its ready events,
            # one wake-up of the loop (fleet/engine/loop_inbox.py).  A closed loop drops it.
            loop_inbox.inbox(loop).post(_resolve_all, resolutions)
        return elsewhere


def _numbered(outcome: Outcome, posted: int) -> Outcome:
    return Outcome(outcome.assignment, outcome.status, outcome.reason, posted)


def _resolve(future: asyncio.Future, outcome: Outcome | None) -> None:
    if not future.done():
        future.set_result(outcome)


def _resolve_all(resolutions: list[tuple[asyncio.Future, Outcome]]) -> None:
    for future, outcome in resolutions:
        _resolve(future, outcome)


rendezvous = Rendezvous()


def announce(task_execution_id: uuid.UUID, outcome: Outcome) -> None:
    """Wake the waiter of ``task_execution_id`` wherever it is: here directly, elsewhere by NOTIFY."""
    if rendezvous.wake(task_execution_id, outcome):
        return
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_notify(%s, %s)",
            [CHANNEL, f"{task_execution_id}:{outcome.assignment}:{outcome.status.value}"],
        )


def announce_many(outcomes: list[tuple[uuid.UUID, Outcome]]) -> None:
    """:func:`announce` for several outcomes: local waiters in one hop, the others in one
    NOTIFY statement."""
    elsewhere = rendezvous.wake_many(outcomes)
    if not elsewhere:
        return
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_notify(%s, n) FROM unnest(%s::text[]) AS n",
            [CHANNEL, [f"{t}:{o.assignment}:{o.status.value}" for t, o in elsewhere]],
        )
