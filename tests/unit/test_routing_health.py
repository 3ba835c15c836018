"""Health classes (healthy / degraded / unhealthy) and the connection-generation counter,
over real WebSockets through the ASGI application.

Here: the unit tests (no database, socket or process); the rest are in tests/integration/test_routing_health.py.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from fleet.executors.fleet.routing.health import Health, classify
from tests.support.socket_registry import forget_sockets  # noqa: F401  (autouse)

NOW = timezone.now()


@pytest.mark.parametrize(
    "state, socket_on, age_s, expected",
    [
        ("live", True, 1, Health.HEALTHY),
        ("live", True, 29, Health.HEALTHY),  # within 2 × 15 s
        ("live", True, 31, Health.DEGRADED),  # late, socket open: still selectable
        ("live", True, 46, Health.UNHEALTHY),  # past the 45 s liveness window
        ("live", False, 1, Health.UNHEALTHY),  # no socket: never selectable
        ("draining", True, 1, Health.DRAINING),
        ("dead", False, 1, Health.DEAD),
    ],
)
def test_classes(state, socket_on, age_s, expected):
    beat = NOW - timedelta(seconds=age_s)
    assert classify(state, "srv" if socket_on else "", beat, NOW, 15.0, 45.0) == expected
