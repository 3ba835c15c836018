"""Test-wide fixtures.

Tests run on the embedded PostgreSQL (pgserver) under a private
CLOACINA_HOME unless DATABASE_URL is given (see cloacina_site/test_settings.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def tmp_path(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pytest's tmp_path, opened to the task user when running as root: task code then runs
    as the unprivileged task user (agents/sandbox/task_isolation.py), and tests hand it
    paths under tmp_path to write markers in, which pytest's own directories (0700, under
    /tmp/pytest-of-root) would refuse.  The folder stays where pytest keeps it, so the logs
    of a failed end-to-end run are still there to read."""
    if os.geteuid() == 0:
        root = tmp_path_factory.getbasetemp().parent
        for folder in [*reversed(tmp_path.parents), tmp_path]:
            if folder == root or root in folder.parents:
                mode = 0o777 if folder == tmp_path else 0o711  # passable, not listable
                os.chmod(folder, folder.stat().st_mode | mode)
    return tmp_path


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
