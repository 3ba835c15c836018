"""API keys for tests: minted through the ORM (in-process tests) or through the real
``mintkey`` CLI (tests that drive a running server, whose database rows must be committed
by a process of their own)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.support.processes import Processes

ROLES = ("agent", "read", "write")


def mint_key(role: str, tenant=None) -> str:
    """A fresh key of ``role`` for ``tenant`` (None for an admin key); returns the token."""
    from fleet.models import ApiKey

    return ApiKey.mint(role, tenant=tenant)[1]


def tenant_keys(tenant_name: str = "acme") -> dict[str, str]:
    """Tenant ``tenant_name`` (created if missing) with one key of each tenant role."""
    from fleet.models import Tenant

    tenant, _ = Tenant.objects.get_or_create(name=tenant_name)
    return {role: mint_key(role, tenant) for role in ROLES}


def bearer(key: str) -> dict:
    """Django test client headers carrying ``key``."""
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


def cli_key(procs: Processes, tenant: str = "acme", role: str = "write") -> str:
    """A key minted by ``manage.py mintkey`` (the tenant must exist)."""
    minted = procs.manage("mintkey", "--tenant", tenant, "--role", role)
    assert minted.returncode == 0, minted.stderr
    return minted.stdout.strip()


def cli_tenant_key(procs: Processes, tenant: str = "acme") -> str:
    """Create ``tenant`` and mint a write key for it through the real CLI."""
    created = procs.manage("createtenant", tenant)
    assert created.returncode == 0, created.stderr
    return cli_key(procs, tenant, "write")


def cli_agent_key(procs: Processes, tenant: str = "acme") -> str:
    """An agent key for an existing ``tenant``, through the real CLI."""
    return cli_key(procs, tenant, "agent")
