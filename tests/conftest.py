"""Test-wide fixtures.

Tests run on the embedded PostgreSQL (pgserver) under a private
CLOACINA_HOME unless DATABASE_URL is given (see cloacina_site/test_settings.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def tmp_path(tmp_path: Path) -> Iterator[Path]:
    """pytest's tmp_path, except as root: there task code runs as the unprivileged task user
    (agents/sandbox/task_isolation.py), and tests hand it paths under tmp_path to write
    markers in, which pytest's own directory (0700, under /tmp/pytest-of-root) would refuse."""
    if os.geteuid() != 0:
        yield tmp_path
        return
    shared = Path(tempfile.mkdtemp(prefix="cloacina-test-"))
    os.chmod(shared, 0o777)
    try:
        yield shared
    finally:
        shutil.rmtree(shared, ignore_errors=True)


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
