"""Tenant and API-key fixtures: tenants acme and globex and a key of each role.

Registered by the conftest.py of each layer that touches the database
(tests/integration, tests/e2e); unit tests have no database and take none of them.
"""

from __future__ import annotations

import pytest

from tests.support.keys import mint_key


@pytest.fixture
def tenant(db):
    from fleet.models import Tenant

    return Tenant.objects.create(name="acme")


@pytest.fixture
def other_tenant(db):
    from fleet.models import Tenant

    return Tenant.objects.create(name="globex")


@pytest.fixture
def write_key(tenant) -> str:
    return mint_key("write", tenant)


@pytest.fixture
def read_key(tenant) -> str:
    return mint_key("read", tenant)


@pytest.fixture
def agent_key(tenant) -> str:
    return mint_key("agent", tenant)


@pytest.fixture
def admin_key(db) -> str:
    return mint_key("admin", None)


@pytest.fixture
def other_write_key(other_tenant) -> str:
    return mint_key("write", other_tenant)


@pytest.fixture(autouse=True)
def close_delivery_pool():
    """The delivery pool's threads keep connections; close them so the test DB can go."""
    yield
    from fleet.executors.fleet.delivery import db as delivery_db

    delivery_db.close()


@pytest.fixture
def short_liveness():
    """Agents are dead after 1.5 s without a beat (0.5 s × 3), for the sweeps under test."""
    from fleet.platform.config import apply_overrides, reset_config

    apply_overrides(heartbeat_interval_s=0.5, liveness_misses=3)
    yield
    reset_config()
