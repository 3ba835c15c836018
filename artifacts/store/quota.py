"""Per-tenant storage quota: the bytes of packages and per-target builds a tenant stores.

Usage is the sum of the ``size`` of the tenant's package and per-target build rows,
whether or not another tenant stores the same bytes: blobs are deduplicated across
tenants, but charging only for unshared blobs would let a tenant learn, from its own
usage, whether someone else had uploaded a given archive.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from django.db import connection
from django.db.models import Sum

from artifacts.models import PackageArtifact, WorkflowPackage
from fleet.platform.config import get_config

if TYPE_CHECKING:
    from fleet.models import Tenant


class QuotaExceeded(Exception):
    """Storing ``adding`` more bytes would take the tenant past its quota."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def storage_quota(tenant: Tenant) -> tuple[int, str]:
    """``(bytes, where the number comes from)``; 0 means unlimited."""
    if tenant.storage_quota_bytes is not None:
        return tenant.storage_quota_bytes, f"tenant {tenant.name}'s storage_quota_bytes"
    return get_config().tenant_storage_bytes, "CLOACINA_TENANT_STORAGE_BYTES"


def storage_used(tenant: Tenant) -> int:
    """Bytes the tenant's packages and per-target builds take (each row counted)."""
    packages = WorkflowPackage.objects.filter(tenant=tenant).aggregate(n=Sum("size"))["n"]
    artifacts = PackageArtifact.objects.filter(tenant=tenant).aggregate(n=Sum("size"))["n"]
    return (packages or 0) + (artifacts or 0)


def _lock_tenant_storage(tenant_id: int) -> None:
    """Serialise the quota check and the store of one tenant's uploads (transaction-scoped),
    so two concurrent uploads cannot both fit in the room left for one."""
    raw = hashlib.sha256(f"tenant_storage/{tenant_id}".encode()).digest()[:8]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_advisory_xact_lock(%s)", [int.from_bytes(raw, "big", signed=True)]
        )


def reserve_storage(tenant: Tenant, adding: int) -> None:
    """Check that ``adding`` bytes fit in the tenant's quota; call inside the transaction
    that stores them (the lock is held until it ends). Raises :class:`QuotaExceeded`."""
    limit, source = storage_quota(tenant)
    if not limit:
        return
    _lock_tenant_storage(tenant.pk)
    used = storage_used(tenant)
    if used + adding > limit:
        raise QuotaExceeded(
            f"storage quota exceeded: tenant {tenant.name} stores {used} bytes of packages and "
            f"builds, this upload adds {adding}, the quota is {limit} bytes ({source})"
        )
