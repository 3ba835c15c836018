"""The per-agent circuit breaker (seed 001): the one owner of the ``breaker_*`` columns.

::

    closed ──N consecutive failures──▶ open ──cool-off passes──▶ half-open
      ▲                                 ▲                          │
      │                                 └───── a failure ──────────┤ (one probe placed)
      └──────────────────── a success ─────────────────────────────┘

* **failures** — a push nobody confirmed (the packet went back to pending, or its run
  was declared lost after ``outbox_max_pushes``), a refusal (the agent answered
  ``refused``), a result timeout (no outcome by the run's result deadline).  They are
  counted per agent; ``breaker_failures`` consecutive ones (CLOACINA_BREAKER_FAILURES,
  default 5) open the breaker for a cool-off (CLOACINA_BREAKER_COOLOFF_S, default 30 s).
* **open** — ``breaker_open_until`` in the future: selection skips the agent (its
  work in flight carries on).  Failures while open change nothing.
* **half-open** — ``breaker_open_until`` passed: exactly one task may be placed on it,
  the probe (the reservation sets ``breaker_probing``).  Its success closes the breaker;
  any failure re-opens it with the cool-off doubled (up to CLOACINA_BREAKER_MAX_COOLOFF_S,
  default 300 s).  A probe that vanished without an outcome (withdrawn by a cancel: the
  agent holds no work) lets another probe through.
* **success** — any outcome the agent reports itself (success, failure, its own task
  timeout): the agent is working.  It resets the failure count; in half-open it closes
  the breaker.

Nothing is written on the hot path while the breaker is closed and unbroken: selection
reads two columns, the reservation folds ``breaker_probing`` into the statement that
takes the slot, and a success touches only agents that had failures (one statement per
result batch that locks no row otherwise).  Agents are locked in id order, as every
writer of several agent rows does.  tests/unit/test_state_owners.py checks that the
columns are written here only.
"""

from __future__ import annotations

import enum
import logging
import uuid
from collections.abc import Iterable
from datetime import datetime

from django.db import connection
from prometheus_client import Counter

from fleet.platform.config import get_config

log = logging.getLogger(__name__)


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Cause(enum.StrEnum):
    """What counted as a failure (the trips counter's label: bounded)."""

    PUSH = "push"  # a push the agent never confirmed
    REFUSAL = "refusal"  # the agent refused a packet
    RESULT_TIMEOUT = "result_timeout"  # no outcome by the result deadline


TRIPS = Counter(
    "cloacina_fleet_breaker_trips",
    "Times an agent's circuit breaker opened (from closed, or re-opened from half-open), "
    "by the kind of the failure that opened it (push, refusal, result_timeout).",
    ["cause"],
)


def state_of(open_until: datetime | None, now: datetime) -> BreakerState:
    """The breaker state an agent row's ``breaker_open_until`` means at ``now``."""
    if open_until is None:
        return BreakerState.CLOSED
    return BreakerState.OPEN if open_until > now else BreakerState.HALF_OPEN


# -- read by selection (SQL over the agent row aliased ``a``) ---------------------------


def admits(agent: str) -> str:
    """SQL: the breaker of the agent row aliased ``agent`` lets a task through — closed,
    or half-open with no probe out (a probe that left no work behind counts as gone)."""
    return (
        f"({agent}.breaker_open_until IS NULL OR ({agent}.breaker_open_until <= now()"
        f" AND (NOT {agent}.breaker_probing OR {agent}.in_flight < 1)))"
    )


def slot_cap(agent: str, free: str) -> str:
    """SQL: how many of ``free`` slots a batch may deal to the agent: one (the probe) when
    its breaker is half-open, else all of them."""
    return f"CASE WHEN {agent}.breaker_open_until IS NOT NULL THEN 1 ELSE {free} END"


def probe_taken(agent: str) -> str:
    """SQL SET clause for the statement that takes a slot on the agent row aliased
    ``agent``: a reservation on a half-open agent is its probe."""
    return f"breaker_probing = {agent}.breaker_open_until IS NOT NULL"


# -- failures and successes ------------------------------------------------------------


def has_something_to_forget_sql(agent: str) -> str:
    """SQL: the agent row aliased ``agent`` has failures counted or a breaker not closed, so
    a success of it must go through :func:`record_successes` (for any other agent that
    statement writes nothing, and a result batch skips it)."""
    return f"({agent}.breaker_failures > 0 OR {agent}.breaker_open_until IS NOT NULL)"


_FAIL = """
WITH n AS (
    SELECT agent_id, count(*) AS n FROM unnest(%(agents)s::uuid[]) AS r(agent_id) GROUP BY agent_id
), locked AS (
    SELECT a.id, n.n,
           a.breaker_open_until IS NOT NULL AND a.breaker_open_until > now() AS open,
           (a.breaker_open_until IS NOT NULL AND a.breaker_open_until <= now())
           OR (a.breaker_open_until IS NULL AND a.breaker_failures + n.n >= %(threshold)s) AS trip
    FROM agents_agent a JOIN n ON n.agent_id = a.id
    WHERE a.state IN ('live', 'draining')
    ORDER BY a.id FOR NO KEY UPDATE OF a
)
UPDATE agents_agent a SET
    breaker_failures = CASE WHEN l.trip THEN 0 WHEN l.open THEN a.breaker_failures
                            ELSE a.breaker_failures + l.n END,
    breaker_open_until = CASE WHEN l.trip THEN now() + make_interval(
                                  secs => LEAST(%(cooloff)s * power(2, LEAST(a.breaker_trips, 20)),
                                                %(max_cooloff)s))
                              ELSE a.breaker_open_until END,
    breaker_trips = CASE WHEN l.trip THEN a.breaker_trips + 1 ELSE a.breaker_trips END,
    breaker_probing = CASE WHEN l.trip THEN false ELSE a.breaker_probing END
FROM locked l
WHERE a.id = l.id
RETURNING a.id, a.name, l.trip, a.breaker_open_until
"""

# Only agents with something to forget are locked (a healthy agent's result writes nothing).
_SUCCEED = """
WITH locked AS (
    SELECT a.id, coalesce(a.breaker_open_until <= now(), false) AS half_open
    FROM agents_agent a
    WHERE a.id = ANY(%(agents)s::uuid[])
      AND (a.breaker_failures > 0 OR a.breaker_open_until <= now())
    ORDER BY a.id FOR NO KEY UPDATE OF a
)
UPDATE agents_agent a SET
    breaker_failures = 0,
    breaker_open_until = CASE WHEN l.half_open THEN NULL ELSE a.breaker_open_until END,
    breaker_trips = CASE WHEN l.half_open THEN 0 ELSE a.breaker_trips END,
    breaker_probing = CASE WHEN l.half_open THEN false ELSE a.breaker_probing END
FROM locked l
WHERE a.id = l.id
RETURNING a.id, a.name, l.half_open
"""


def record_failures(agent_ids: Iterable[uuid.UUID | None], cause: Cause) -> list[uuid.UUID]:
    """Count one failure per entry of ``agent_ids`` (None entries: no agent, skipped), in
    the caller's transaction; returns the agents whose breaker this opened."""
    agents = [a for a in agent_ids if a is not None]
    if not agents:
        return []
    config = get_config()
    with connection.cursor() as cursor:
        cursor.execute(
            _FAIL,
            {
                "agents": agents,
                "threshold": config.breaker_failures,
                "cooloff": config.breaker_cooloff_s,
                "max_cooloff": config.breaker_max_cooloff_s,
            },
        )
        rows = cursor.fetchall()
    opened = []
    for agent_id, name, tripped, until in rows:
        if tripped:
            opened.append(agent_id)
            TRIPS.labels(cause=cause.value).inc()
            log.warning(
                "circuit breaker of agent %s opened (%s) until %s: no new work until then",
                name, cause.value, until.isoformat(),
            )  # fmt: skip
    return opened


def record_successes(agent_ids: Iterable[uuid.UUID | None]) -> list[uuid.UUID]:
    """The agents answered with an outcome of their own: forget their failures and close
    a half-open breaker (in the caller's transaction); returns the agents it closed."""
    agents = sorted({a for a in agent_ids if a is not None})
    if not agents:
        return []
    with connection.cursor() as cursor:
        cursor.execute(_SUCCEED, {"agents": agents})
        rows = cursor.fetchall()
    closed = []
    for agent_id, name, was_half_open in rows:
        if was_half_open:
            closed.append(agent_id)
            log.info("circuit breaker of agent %s closed: its probe succeeded", name)
    return closed
