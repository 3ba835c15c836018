"""The slow layer: real processes — `serve`, `runagent` (plain and gated), the CLI,
agents started by the actuators, the chaos runs, docker, other architectures and
headless Chromium (tests/e2e/browser/)."""

from __future__ import annotations

import pytest

from tests.support.chaos import KillablePostgres
from tests.support.console import *  # noqa: F403 (the console fixtures, for the browser tests)
from tests.support.hostile import TENANT, Served
from tests.support.keys import tenant_keys
from tests.support.processes import Processes
from tests.support.tenancy import *  # noqa: F403 (the tenant and key fixtures)


@pytest.fixture
def served(transactional_db, tmp_path):
    """A `serve` (in-process executor) on the test database, with tenant acme's keys."""
    keys = tenant_keys(TENANT)
    with Processes(tmp_path) as procs:
        yield Served(procs, procs.serve(), keys)


@pytest.fixture
def own_postgres(tmp_path):
    """A PostgreSQL of the test's own (crashable, restartable) and a database on it:
    ``(KillablePostgres, url)``.  Stopped at the end whatever state the test left it in."""
    pg = KillablePostgres(tmp_path / "pg")
    try:
        yield pg, pg.create_database("cloacina")
    finally:
        pg.stop()
