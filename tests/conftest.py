"""Test-wide fixtures.

Tests run on the embedded PostgreSQL (pgserver) under a private
CLOACINA_HOME unless DATABASE_URL is given (see cloacina_site/test_settings.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def tenant(db):
    from fleet.models import Tenant

    return Tenant.objects.create(name="acme")


@pytest.fixture
def other_tenant(db):
    from fleet.models import Tenant

    return Tenant.objects.create(name="globex")


def _key(tenant, role):
    from fleet.models import ApiKey

    return ApiKey.mint(role, tenant=tenant)[1]


@pytest.fixture
def write_key(tenant) -> str:
    return _key(tenant, "write")


@pytest.fixture
def read_key(tenant) -> str:
    return _key(tenant, "read")


@pytest.fixture
def agent_key(tenant) -> str:
    return _key(tenant, "agent")


@pytest.fixture
def admin_key(db) -> str:
    return _key(None, "admin")


@pytest.fixture
def other_write_key(other_tenant) -> str:
    return _key(other_tenant, "write")


def bearer(key: str) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}
