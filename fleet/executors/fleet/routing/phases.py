"""An agent's phase: the finer machine an operator reads, derived from its row.

``state`` is the roster's (live, draining, dead, stopped); the phase splits ``live`` by
its socket and its load, so it costs no write of its own::

    connecting ──socket──▶ ready ⇄ busy ──drain──▶ draining ──deregister──▶ stopped
        │                   │  ▲                       │
        │          socket lost│  │socket back          └──evict──▶ dead
        │                   ▼  │
        └──────────────▶ disconnected ──liveness window──▶ dead

* connecting   — live, registered, no delivery socket opened yet;
* ready        — live, socket open, a free slot;
* busy         — live, socket open, every slot taken (``in_flight ≥ max_concurrency``);
* draining     — finishing its work, no new work (state draining);
* disconnected — live, its socket gone, still inside the liveness window (past it the
  sweep declares it dead);
* stopped      — left cleanly: deregistered (SIGTERM, a deprovision's drain);
* dead         — evicted: silent past the liveness window, an overdue drain, a revoked key,
  replaced by a new registration of its name.

Every transition but ready ⇄ busy is a lifecycle event
(:mod:`fleet.executors.fleet.lifecycle` counts them); ready ⇄ busy follows the slot
counter on the hot path and is only derived, never counted.
"""

from __future__ import annotations

import enum


class Phase(enum.StrEnum):
    CONNECTING = "connecting"
    READY = "ready"
    BUSY = "busy"
    DRAINING = "draining"
    DISCONNECTED = "disconnected"
    STOPPED = "stopped"
    DEAD = "dead"


# ``new``: the "from" of a registration (the transitions counter's label).
NEW = "new"

_BY_STATE = {"draining": Phase.DRAINING, "dead": Phase.DEAD, "stopped": Phase.STOPPED}


def of(state: str, connected: bool, generation: int, in_flight: int, slots: int) -> Phase:
    """The phase of an agent row (``connected``: it holds a delivery socket somewhere;
    ``generation``: how many sockets it ever opened)."""
    if state in _BY_STATE:
        return _BY_STATE[state]
    if not connected:
        return Phase.CONNECTING if generation == 0 else Phase.DISCONNECTED
    return Phase.BUSY if in_flight >= slots else Phase.READY


# The columns :func:`of` takes, as a CTE of the row before a transition names them.
BEFORE = ("p_state", "p_connected", "p_generation", "p_in_flight", "p_slots")


def columns(agent: str) -> str:
    """SQL select list: the columns :func:`of` takes (in its order, named :data:`BEFORE`)
    of the agent row aliased ``agent``."""
    values = (
        f"{agent}.state",
        f"{agent}.connected_to <> ''",
        f"{agent}.connection_generation",
        f"{agent}.in_flight",
        f"{agent}.max_concurrency",
    )
    return ", ".join(f"{value} AS {name}" for value, name in zip(values, BEFORE, strict=True))


def before(cte: str) -> str:
    """SQL: the :data:`BEFORE` columns of the CTE ``cte`` (for a RETURNING list)."""
    return ", ".join(f"{cte}.{name}" for name in BEFORE)
