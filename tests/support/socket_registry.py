"""The process's registry of delivery sockets, emptied around each test: the fixture alone,
without the ASGI application (unit tests import it without loading Django's URLs)."""

from __future__ import annotations

import pytest

from fleet.executors.fleet.delivery import local_sockets


@pytest.fixture(autouse=True)
def forget_sockets():
    """Import it into a test module: each test starts and ends with no registered socket."""
    local_sockets.clear()
    yield
    local_sockets.clear()
