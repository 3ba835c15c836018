"""Health classes of an agent, as selection and the console see them.

* healthy   — live, its delivery socket open, a heartbeat within 2 × the interval;
* degraded  — socket open but the last heartbeat is older than 2 × the interval: still
  selectable, ranked after every healthy agent (a busy host may only be slow to beat);
* unhealthy — no socket (or no beat within the liveness window): never selected; the
  liveness sweep alone decides when it is dead (eviction stays the sweeper's call);
* draining / dead / stopped — the roster states: never selected.

Which socket counts is decided by ``connected_to`` + ``connection_generation`` (see
:func:`fleet.executors.fleet.roster.open_socket` / ``close_socket``): a stale disconnect of an older
connection never clears a newer one, so a freshly reconnected agent stays healthy.
"""

from __future__ import annotations

import enum
from datetime import datetime, timedelta

from django.db.models import Q

DEGRADED_AFTER_INTERVALS = 2.0


class Health(enum.StrEnum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
    DEAD = "dead"
    STOPPED = "stopped"


def degraded_after_s(heartbeat_interval_s: float) -> float:
    """Seconds without a heartbeat after which a connected agent counts as degraded."""
    return DEGRADED_AFTER_INTERVALS * heartbeat_interval_s


def classify(
    state: str,
    connected_to: str,
    last_heartbeat: datetime,
    now: datetime,
    heartbeat_interval_s: float,
    liveness_window_s: float,
) -> Health:
    """The health class of one agent at ``now`` (the rules in the module docstring)."""
    if state in (Health.DEAD, Health.STOPPED):
        return Health(state)
    if state == "draining":
        return Health.DRAINING
    age = (now - last_heartbeat).total_seconds()
    if not connected_to or age > liveness_window_s:
        return Health.UNHEALTHY
    if age > degraded_after_s(heartbeat_interval_s):
        return Health.DEGRADED
    return Health.HEALTHY


# SQL over ``agents_agent a``: true for a degraded candidate (it is sorted last).
DEGRADED_SQL = "a.last_heartbeat < now() - make_interval(secs => %(degraded_s)s)"


def health_q(
    health: str, now: datetime, heartbeat_interval_s: float, liveness_window_s: float
) -> Q:
    """The rows :func:`classify` puts in ``health`` at ``now``, as an ORM filter on Agent.

    Lists filter and sort by health in the database with this (a page of 1,000 agents
    is never classified in Python); tests/integration/test_console_agent_list.py checks
    that it agrees with :func:`classify` on every class and boundary.
    """
    if health in (Health.DEAD, Health.STOPPED, Health.DRAINING):
        return Q(state=str(health))
    stale = now - timedelta(seconds=liveness_window_s)
    late = now - timedelta(seconds=degraded_after_s(heartbeat_interval_s))
    live, socket = Q(state="live"), ~Q(connected_to="")
    if health == Health.UNHEALTHY:
        return live & (Q(connected_to="") | Q(last_heartbeat__lt=stale))
    in_window = live & socket & Q(last_heartbeat__gte=stale)
    if health == Health.DEGRADED:
        return in_window & Q(last_heartbeat__lt=late)
    if health == Health.HEALTHY:
        return in_window & Q(last_heartbeat__gte=late)
    raise ValueError(f"unknown health class {health!r}")
