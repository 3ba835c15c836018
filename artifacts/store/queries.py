"""Read-side questions other modules ask about packages, always scoped by tenant.

The scheduler asks which package runs a workflow; the dispatcher asks which
agents can load it and which digest to ship; the download endpoint asks
whether a digest belongs to the caller's tenant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from django.db import connection
from django.db.models import QuerySet
from packaging.version import InvalidVersion, Version

from artifacts.models import PackageArtifact, PackageKind, WorkflowPackage
from artifacts.store.storage import DIGEST_RE, BlobNotFound, load_blob

if TYPE_CHECKING:
    from fleet.models import Tenant


# Raw SQL: every execution start asks this, and compiling the ORM's ordered query was
# the largest single cost of starting one.  The same query the ORM would run, its columns
# named in the model's field order so the row becomes the model without a RawQuerySet
# (which matched columns to fields and looked up converters on every call).
_PACKAGE_FIELDS = tuple(WorkflowPackage._meta.concrete_fields)
_PACKAGE_ATTNAMES = tuple(field.attname for field in _PACKAGE_FIELDS)


def active_package_select(columns: str, tenant: str = "%s", workflow: str = "%s") -> str:
    """SQL selecting ``columns`` of the active package (see :func:`active_package`) of the
    tenant and workflow given as the placeholders ``tenant`` and ``workflow``: the one
    definition of "active", for the statements that read it inside a larger one."""
    return f"""
SELECT {columns}
FROM {WorkflowPackage._meta.db_table}
WHERE tenant_id = {tenant} AND workflow_name = {workflow} AND NOT superseded
ORDER BY built_at DESC, id DESC LIMIT 1
"""


_ACTIVE_PACKAGE = active_package_select(", ".join(field.column for field in _PACKAGE_FIELDS))


def active_package(tenant: Tenant | int, workflow_name: str) -> WorkflowPackage | None:
    """The package new executions of ``workflow_name`` use: the newest built, non-superseded
    package of the tenant that declares that workflow."""
    tenant_id = tenant if isinstance(tenant, int) else tenant.pk
    with connection.cursor() as cursor:
        cursor.execute(_ACTIVE_PACKAGE, [tenant_id, workflow_name])
        row = cursor.fetchone()
    if row is None:
        return None
    values = [
        field.from_db_value(value, None, connection) if hasattr(field, "from_db_value") else value
        for field, value in zip(_PACKAGE_FIELDS, row, strict=True)
    ]  # the JSON fields: psycopg hands jsonb to Django as text
    return WorkflowPackage.from_db(connection.alias, _PACKAGE_ATTNAMES, values)


def packages_for(tenant: Tenant | int) -> QuerySet[WorkflowPackage]:
    """The tenant's packages with their per-target artifacts prefetched (one extra query)."""
    return (
        WorkflowPackage.objects.filter(tenant=tenant)
        .prefetch_related("artifacts")
        .order_by("name", "-built_at", "-id")
    )


def find_package(tenant: Tenant | int, name: str, version: str) -> WorkflowPackage | None:
    """The package ``name`` at ``version``; "1.0" finds "1.0.0" (PEP 440 equality)."""
    candidates = list(WorkflowPackage.objects.filter(tenant=tenant, name=name))
    for package in candidates:
        if package.version == version:
            return package
    try:
        wanted = Version(version)
    except InvalidVersion:
        return None
    return next((p for p in candidates if Version(p.version) == wanted), None)


def tenant_owns_digest(tenant: Tenant | int, digest: str) -> bool:
    """Whether a package or per-target artifact of ``tenant`` is stored under ``digest``."""
    if not DIGEST_RE.match(digest or ""):
        return False
    return (
        WorkflowPackage.objects.filter(tenant=tenant, digest=digest).exists()
        or PackageArtifact.objects.filter(tenant=tenant, content_hash=digest).exists()
    )


def artifact_bytes(tenant: Tenant | int, digest: str) -> bytes | None:
    """The artifact's bytes if it belongs to ``tenant``; None otherwise — the caller cannot
    tell "another tenant's" from "absent", by design."""
    if not tenant_owns_digest(tenant, digest):
        return None
    try:
        return load_blob(digest)
    except BlobNotFound:
        return None


def runnable_triples(package: WorkflowPackage) -> frozenset[str] | None:
    """Target triples whose agents can load ``package``; None means any (python packages)."""
    if package.kind == PackageKind.PYTHON:
        return None
    extra = package.artifacts.values_list("target_triple", flat=True)
    return frozenset({package.host_triple, *extra})


@dataclass(frozen=True)
class ResolvedArtifact:
    digest: str
    target_triple: str  # the triple the artifact was built for (stamped on the work packet)


def resolve_artifact(package: WorkflowPackage, target_triple: str) -> ResolvedArtifact | None:
    """Which artifact to ship to an agent of ``target_triple``, or None if it cannot run it.

    Python packages run anywhere: the primary digest, stamped with the agent's own
    triple. Native ones: the per-target build if there is one, else the primary
    build when the agent shares the server's host triple.
    """
    if package.kind == PackageKind.PYTHON:
        return ResolvedArtifact(package.digest, target_triple)
    per_target = (
        package.artifacts.filter(tenant_id=package.tenant_id, target_triple=target_triple)
        .values_list("content_hash", flat=True)
        .first()
    )
    if per_target:
        return ResolvedArtifact(per_target, target_triple)
    if package.host_triple == target_triple:
        return ResolvedArtifact(package.digest, package.host_triple)
    return None
