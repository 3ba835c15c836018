"""Tenant and API-key fixtures: tenants acme and globex and a key of each role.

Registered by the conftest.py of each layer that touches the database
(tests/integration, tests/e2e: ``from tests.support.tenancy import *``); unit tests have
no database and take none of them.
"""

from __future__ import annotations

import pytest

from tests.support.keys import mint_key

__all__ = [
    "admin_key",
    "agent_key",
    "close_delivery_pool",
    "other_tenant",
    "other_write_key",
    "read_key",
    "short_liveness",
    "tenant",
    "write_key",
]


@pytest.fixture
def tenant(db):
    from fleet.models import Tenant

    return Tenant.objects.create(name="acme")


@pytest.fixture
def other_tenant(db):
    from fleet.models import Tenant

    return Tenant.objects.create(name="globex")


def _tenant_key(role: str):
    """The fixture ``<role>_key``: a key of that role for tenant acme."""

    def key(tenant) -> str:
        return mint_key(role, tenant)

    return pytest.fixture(key, name=f"{role}_key")


write_key = _tenant_key("write")
read_key = _tenant_key("read")
agent_key = _tenant_key("agent")


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
