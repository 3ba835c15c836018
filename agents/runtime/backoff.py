"""Exponential backoff with full jitter, and the ±10 % jitter of the heartbeat interval.

Every agent of a fleet loses the server at the same moment when it restarts; jitter
spreads their reconnects (and their beats) so they do not arrive as one thundering herd.
"""

from __future__ import annotations

import asyncio
import random

RECONNECT_BASE_S = 0.2
RECONNECT_CAP_S = 10.0
HEARTBEAT_JITTER = 0.10  # ±10 % of the advertised interval
# A 429 at registration (rate or cap) lasts seconds to minutes: start slower than a
# reconnect and wait up to a minute between tries, however long the server asks for.
RATE_LIMITED_BASE_S = 1.0
RATE_LIMITED_CAP_S = 60.0
# Agents refused together come back spread over at least this long (10 % of a longer wait).
RATE_LIMITED_SPREAD_S = 0.3
# A server shutting down closes every socket at once: its agents reconnect elsewhere at
# once, spread over this long so the other replicas do not take them all in one instant.
MOVE_SPREAD_S = 1.0


class Backoff:
    """``next_delay()`` grows base × 2^n up to ``cap_s``; each delay is drawn in [½d, d]."""

    def __init__(
        self,
        base_s: float = RECONNECT_BASE_S,
        cap_s: float = RECONNECT_CAP_S,
        rng: random.Random | None = None,
    ) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self.failures = 0
        # The module's generator unless told otherwise: every outcome report makes a
        # Backoff, and seeding a fresh Random from os.urandom each time was measurable.
        self._rng = rng or random

    def next_delay(self) -> float:
        ceiling = min(self.cap_s, self.base_s * (2**self.failures))
        self.failures = min(self.failures + 1, 30)  # 2**30 × base is past any cap
        # Half fixed, half random: never zero (no hot loop), still decorrelated.
        return ceiling / 2 + self._rng.uniform(0, ceiling / 2)

    def reset(self) -> None:
        self.failures = 0


def rate_limited_delay(
    backoff: Backoff,
    retry_after_s: float | None,
    cap_s: float = RATE_LIMITED_CAP_S,
    rng: random.Random | None = None,
) -> float:
    """How long to wait after a 429: the longer of ``backoff``'s next (jittered) delay and
    the server's Retry-After plus a random spread of 10 % of it, at least
    RATE_LIMITED_SPREAD_S (agents refused together do not all come back in the same
    second), never more than ``cap_s``."""
    delay = backoff.next_delay()
    if retry_after_s is not None:
        r = rng or random
        spread = max(retry_after_s * HEARTBEAT_JITTER, RATE_LIMITED_SPREAD_S)
        delay = max(delay, retry_after_s + r.uniform(0, spread))
    return min(cap_s, delay)


def move_delay(rng: random.Random | None = None) -> float:
    """The pause before reconnecting elsewhere after a server's "go elsewhere" close."""
    return (rng or random).uniform(0, MOVE_SPREAD_S)


def jittered(interval_s: float, rng: random.Random | None = None) -> float:
    """``interval_s`` moved by up to ±10 %."""
    r = rng or random
    return interval_s * (1 + r.uniform(-HEARTBEAT_JITTER, HEARTBEAT_JITTER))


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set (True) or ``timeout_s`` passes (False).

    Not ``asyncio.wait_for``: on Python 3.11 it can swallow a cancellation that
    arrives as the event fires, leaving a loop that can no longer be stopped.
    """
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
        return True
    except TimeoutError:
        return False
