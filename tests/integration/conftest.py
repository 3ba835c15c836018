"""The middle layer: the database (pytest-django), the ASGI application in process
(Channels communicators, Django's test client) and fakes at the HTTP boundary; no
`serve` or `runagent` process (those are tests/e2e)."""

from __future__ import annotations

from tests.support.console import *  # noqa: F403 (the console fixtures)
from tests.support.packages import local_index  # noqa: F401
from tests.support.tenancy import *  # noqa: F403 (the tenant and key fixtures)
