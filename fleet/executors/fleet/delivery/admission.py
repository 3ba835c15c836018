"""How many agent registrations and delivery-socket opens this server process admits per
second (``CLOACINA_AGENT_ADMISSIONS_PER_S``; 0 = unlimited).

A deploy restarts every agent at once, and a server restart drops every socket at once:
without a bound, a thousand registrations and hellos arrive in the same second, queue for
the database pool and the roster lock, and the beats of the agents already back wait
behind them until their liveness window runs out.  The bound keeps the server's work per
second flat; a caller past it is told when to come back (429 with ``Retry-After``, or close
code 4013 with "retry after N s" on the socket).

The rate is a generic cell rate (GCRA): a theoretical arrival time advanced by 1/rate per
admission, with one second's worth of burst.  A refused caller is given a turn of its own
after the ones already given (``_booked`` moves on by 1/rate per refusal), so a thousand
callers refused in one instant come back spread over a thousand / rate seconds, not all
together again.  Per process, in memory: each replica admits its own share.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from fleet.platform.config import get_config

BURST_S = 1.0  # admissions may run this many seconds ahead of the rate


class Admission:
    """A thread-safe rate of admissions; ``admit()`` answers 0 (in) or the seconds to wait."""

    def __init__(self, rate_per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_per_s = rate_per_s
        self._clock = clock
        self._lock = threading.Lock()
        self._tat = 0.0  # theoretical arrival time of the next admission
        self._booked = 0.0  # the latest turn promised to a refused caller

    def admit(self) -> float:
        """0.0 when admitted now, else how many seconds until this caller's turn (> 0)."""
        if self.rate_per_s <= 0:
            return 0.0
        interval = 1.0 / self.rate_per_s
        with self._lock:
            now = self._clock()
            tat = max(self._tat, now)
            if tat - now <= BURST_S + 1e-9:  # (float sums of 1/rate)
                self._tat = tat + interval
                return 0.0
            # The first refused caller's turn is when the bucket has room again; each next
            # one's, an interval after the turn given before it.
            self._booked = max(self._booked + interval, tat - BURST_S)
            return self._booked - now


def retry_after_s(wait_s: float) -> int:
    """A wait as whole seconds for a Retry-After header or a close reason (at least 1)."""
    return max(1, math.ceil(wait_s))


_admission: Admission | None = None
_admission_lock = threading.Lock()


def reset() -> None:
    """Forget this process's admission state (tests; the next call starts afresh)."""
    global _admission
    with _admission_lock:
        _admission = None


def agents() -> Admission:
    """This process's admission of agents, at the configured rate (rebuilt if it changes)."""
    global _admission
    rate = get_config().agent_admissions_per_s
    with _admission_lock:
        if _admission is None or _admission.rate_per_s != rate:
            _admission = Admission(rate)
        return _admission
