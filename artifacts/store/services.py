"""Publishing packages and per-target builds: validate, build, store, supersede.

Every mutation of the package tables goes through :func:`publish_package` or
:func:`publish_target_artifact`.  All checks run before the first write and
the writes share one transaction, so a rejected upload changes nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from django.db import connection, transaction
from packaging.version import Version

from agents.protocol.triples import TripleError, host_triple, parse_triple
from agents.sandbox.archive import ArchiveError
from artifacts.models import PackageArtifact, PackageKind, WorkflowPackage
from artifacts.store.build import canonical_archive, sha256_hex
from artifacts.store.queries import active_package, find_package
from artifacts.store.quota import QuotaExceeded, reserve_storage
from artifacts.store.storage import load_blob, store_blob
from artifacts.store.validation import (
    PackageError,
    PackageLimitError,
    ValidatedPackage,
    validate_package,
)
from fleet.platform.config import get_config
from fleet.platform.errors import DomainError, ErrorKind

if TYPE_CHECKING:
    from fleet.models import Tenant

# Re-exported: callers may reach the read side through this module too.
__all__ = [
    "UploadRejected",
    "active_package",
    "load_blob",
    "publish_package",
    "publish_target_artifact",
    "refuse_oversized_upload",
]


class UploadRejected(DomainError):
    """An upload or build was refused; ``kind`` says what kind of refusal, the message says why."""


def refuse_oversized_upload(size: int | None) -> None:
    """413 for an upload of ``size`` bytes past the limit: the API and the console check the
    declared size before reading an upload into memory, and publishing checks the bytes."""
    limit = get_config().max_package_bytes
    if size is not None and size > limit:
        raise UploadRejected(
            ErrorKind.TOO_LARGE,
            f"upload is {size} bytes; the limit is {limit} (CLOACINA_MAX_PACKAGE_BYTES)",
        )


def _check_size(data: bytes) -> None:
    refuse_oversized_upload(len(data))


def _check_built_size(built: bytes, what: str) -> None:
    """The stored archive is bounded like the upload: links become copies and a zip may
    compress better than the canonical tar.gz, so a small upload can rebuild much larger."""
    limit = get_config().max_package_bytes
    if len(built) > limit:
        raise UploadRejected(
            ErrorKind.TOO_LARGE,
            f"{what} rebuilds to a {len(built)}-byte archive (links stored as copies); the "
            f"limit is {limit} (CLOACINA_MAX_PACKAGE_BYTES)",
        )


def _store(tenant: Tenant, built: bytes) -> None:
    """Store ``built`` within the tenant's quota (inside the publishing transaction)."""
    try:
        reserve_storage(tenant, len(built))
    except QuotaExceeded as exc:
        raise UploadRejected(ErrorKind.TOO_LARGE, exc.detail) from None
    store_blob(built)


def _validate(data: bytes) -> ValidatedPackage:
    _check_size(data)
    try:
        return validate_package(data)
    except ArchiveError as exc:
        raise UploadRejected(ErrorKind.MALFORMED, f"bad archive: {exc}") from None
    except PackageLimitError as exc:
        raise UploadRejected(ErrorKind.TOO_LARGE, f"package too large to validate: {exc}") from None
    except PackageError as exc:
        raise UploadRejected(ErrorKind.INVALID, f"invalid package: {exc}") from None


def _lock_package_name(tenant_id: int, name: str) -> None:
    """Serialise publishes of one package name in one tenant (transaction-scoped), so
    version comparison and superseding never race."""
    raw = hashlib.sha256(f"workflow_packages/{tenant_id}/{name}".encode()).digest()[:8]
    key = int.from_bytes(raw, "big", signed=True)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [key])


def publish_package(
    tenant: Tenant,
    data: bytes,
    on_published: Callable[[WorkflowPackage], object] | None = None,
) -> tuple[WorkflowPackage, bool]:
    """Validate, build and store an uploaded package; returns ``(package, created)``.

    Re-uploading identical content for an existing version returns the existing
    row (``created=False``); different content for it raises 409.  A newer
    version supersedes the older ones of the same package name.  ``on_published``
    runs with a newly created package inside the publishing transaction (the
    surface syncs the package's declared schedules there), so it commits with it.
    """
    package = _validate(data)
    built = canonical_archive(package.members)
    _check_built_size(built, f"package {package.name} {package.version}")
    digest = sha256_hex(built)
    version = Version(package.version)
    with transaction.atomic():
        _lock_package_name(tenant.pk, package.name)
        siblings = list(WorkflowPackage.objects.filter(tenant=tenant, name=package.name))
        same = next((p for p in siblings if Version(p.version) == version), None)
        if same is not None:
            if same.digest == digest:
                return same, False
            raise UploadRejected(
                ErrorKind.CONFLICT,
                f"package {package.name} version {same.version} already exists with different "
                "content; publish it under a new version",
            )
        _store(tenant, built)
        created = WorkflowPackage.objects.create(
            tenant=tenant,
            name=package.name,
            version=package.version,
            kind=package.kind,
            workflow_name=package.workflow_name,
            digest=digest,
            size=len(built),
            host_triple=host_triple(),
            manifest=package.manifest,
            superseded=any(Version(p.version) > version for p in siblings),
        )
        older = [p.pk for p in siblings if Version(p.version) < version and not p.superseded]
        WorkflowPackage.objects.filter(pk__in=older).update(superseded=True)
        if on_published is not None:
            on_published(created)
    return created, True


def _same_dag(primary: dict, upload: dict) -> bool:
    return primary["workflow"] == upload["workflow"] and primary["tasks"] == upload["tasks"]


def publish_target_artifact(
    tenant: Tenant,
    name: str,
    version: str,
    target_triple: str,
    data: bytes,
    digest: str | None = None,
) -> tuple[PackageArtifact, bool]:
    """Store a per-target build of a native package; returns ``(artifact, created)``.

    ``digest``, if given, must be the sha256 of ``data`` (an end-to-end integrity
    check by the uploader).  Identical content for an existing target is
    idempotent; different content is a 409.
    """
    _check_size(data)
    try:
        parse_triple(target_triple)
    except TripleError as exc:
        raise UploadRejected(ErrorKind.INVALID, str(exc)) from None
    if digest is not None and digest.strip().lower() != sha256_hex(data):
        raise UploadRejected(
            ErrorKind.INVALID,
            f"digest {digest!r} does not match the sha256 of the upload ({sha256_hex(data)})",
        )
    package = find_package(tenant, name, version)
    if package is None:
        raise UploadRejected(ErrorKind.NOT_FOUND, f"package {name} version {version} not found")
    if package.kind != PackageKind.NATIVE:
        raise UploadRejected(
            ErrorKind.INVALID,
            "python packages are architecture-independent: they run from source on any agent, "
            f"so {name} {package.version} takes no per-target builds",
        )
    upload = _validate(data)
    if upload.name != package.name or Version(upload.version) != Version(package.version):
        raise UploadRejected(
            ErrorKind.INVALID,
            f"the archive is {upload.name} version {upload.version}, but the URL names "
            f"{package.name} version {package.version}",
        )
    if not _same_dag(package.manifest, upload.manifest):
        raise UploadRejected(
            ErrorKind.INVALID,
            "the archive's [workflow] and [[tasks]] differ from the primary build of "
            f"{package.name} {package.version}; a per-target build must declare the same DAG",
        )
    built = canonical_archive(upload.members)
    _check_built_size(built, f"the {target_triple} build of {package.name} {package.version}")
    content_hash = sha256_hex(built)
    with transaction.atomic():
        _lock_package_name(tenant.pk, package.name)
        existing = PackageArtifact.objects.filter(
            tenant=tenant,
            package_name=package.name,
            version=package.version,
            target_triple=target_triple,
        ).first()
        if existing is not None:
            if existing.content_hash == content_hash:
                return existing, False
            raise UploadRejected(
                ErrorKind.CONFLICT,
                f"{package.name} {package.version} already has a different build for "
                f"{target_triple}",
            )
        _store(tenant, built)
        artifact = PackageArtifact.objects.create(
            tenant=tenant,
            package=package,
            package_name=package.name,
            version=package.version,
            target_triple=target_triple,
            content_hash=content_hash,
            size=len(built),
        )
    return artifact, True
