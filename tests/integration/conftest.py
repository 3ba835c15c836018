"""The middle layer: the database (pytest-django), the ASGI application in process
(Channels communicators, Django's test client) and fakes at the HTTP boundary; no
`serve` or `runagent` process (those are tests/e2e)."""

from __future__ import annotations

import pytest

from fleet.executors.fleet.delivery import admission
from fleet.platform.config import reset_config
from tests.support.console import *  # noqa: F403 (the console fixtures)
from tests.support.packages import local_index  # noqa: F401
from tests.support.tenancy import *  # noqa: F403 (the tenant and key fixtures)


@pytest.fixture
def setting(monkeypatch):
    """Set configuration variables for one test: ``setting(NAME="value", …)``; the
    configuration and the process's registration admission (its rates and caps) are re-read."""

    def set_values(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)
        reset_config()
        admission.reset()

    yield set_values
    monkeypatch.undo()
    reset_config()
    admission.reset()
