"""The build-job table (``package_build_jobs``): every statement that moves a job.

A job is queued by ``POST /packages/{name}/{version}/builds`` and run in the
background by :mod:`artifacts.builds.runner`.  States: queued → running →
succeeded | failed; a running job whose server died (or stopped) goes back to
queued until it has had :data:`MAX_BUILD_ATTEMPTS`, then fails saying why.

Every transition out of ``running`` is compare-and-set on the claim
(``claimed_by`` and ``attempts``), so a server that was presumed dead and
finishes late changes nothing.
"""

from __future__ import annotations

import hashlib
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING

from django.db import IntegrityError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from artifacts.models import ACTIVE_BUILD_STATES, BuildJob, BuildState, WorkflowPackage
from artifacts.store import wheels
from artifacts.store.queries import find_package
from artifacts.store.services import UploadRejected
from fleet.engine import server_registry
from fleet.models import ServerInstance
from fleet.platform.errors import ErrorKind

if TYPE_CHECKING:
    from fleet.models import Tenant

MAX_BUILD_ATTEMPTS = 2  # a build whose server died twice under it is failed, not retried again
ENQUEUE_TRIES = 3  # the active job may finish between our look and our insert
MAX_DETAIL_CHARS = 2000
STUCK_GRACE_S = 300.0  # past pip's own timeout: reading, vendoring and publishing the wheels
# One advisory lock serialises claims over every server, so the global cap is exact.
CLAIM_LOCK = int.from_bytes(hashlib.sha256(b"package_build_jobs/claim").digest()[:8], "big") >> 1

_CLAIM_SQL = """
WITH running AS (
    SELECT count(*) AS n FROM package_build_jobs WHERE state = 'running'
), picked AS MATERIALIZED (
    SELECT id FROM package_build_jobs
    WHERE state = 'queued'
    ORDER BY created_at
    LIMIT GREATEST(0, LEAST(%(slots)s, %(cap)s - (SELECT n FROM running)))
    FOR UPDATE SKIP LOCKED
)
UPDATE package_build_jobs j
SET state = 'running', claimed_by = %(server)s, attempts = j.attempts + 1,
    started_at = now(), detail = ''
FROM picked WHERE j.id = picked.id
RETURNING j.id
"""


def status_url(job: BuildJob) -> str:
    return f"/api/v1/builds/{job.pk}"


def _active_job(tenant: Tenant) -> BuildJob | None:
    return BuildJob.objects.filter(tenant=tenant, state__in=ACTIVE_BUILD_STATES).first()


def _same_build(job: BuildJob, package: WorkflowPackage, target_triple: str) -> bool:
    return job.package_id == package.pk and job.target_triple == target_triple


def _busy(job: BuildJob) -> UploadRejected:
    return UploadRejected(
        ErrorKind.CONFLICT,
        f"this tenant already has a build {job.state}: {job.package_name} {job.version} for "
        f"{job.target_triple} ({status_url(job)}); one build per tenant at a time — "
        "wait for it to finish, then ask again",
    )


def refuse_if_busy(tenant: Tenant, name: str, version: str, target_triple: str) -> None:
    """409 at once when the tenant has another build queued or running (before the request
    reads the package's archive; :func:`enqueue_build` decides again under the index)."""
    active = _active_job(tenant)
    if active is None:
        return
    package = find_package(tenant, name, version)
    if package is not None and not _same_build(active, package, target_triple):
        raise _busy(active)


def enqueue_build(
    tenant: Tenant, package: WorkflowPackage, target_triple: str
) -> tuple[BuildJob, bool]:
    """Queue a build of ``package`` for ``target_triple``; returns ``(job, created)``.

    One queued or running build per tenant: asking again for the same build joins it
    (``created`` False); asking for another one is a 409 naming the active build.
    """
    for _ in range(ENQUEUE_TRIES):
        active = _active_job(tenant)
        if active is not None:
            if _same_build(active, package, target_triple):
                return active, False
            raise _busy(active)
        try:
            with transaction.atomic():
                job = BuildJob.objects.create(
                    id=uuid.uuid4(),
                    tenant=tenant,
                    package=package,
                    package_name=package.name,
                    version=package.version,
                    target_triple=target_triple,
                )
            return job, True
        except IntegrityError:
            continue  # another request queued one first (the partial unique index): look again
    raise UploadRejected(
        ErrorKind.CONFLICT, "this tenant's builds are changing too fast; ask again"
    )


def job_for(tenant: Tenant, job_id: uuid.UUID) -> BuildJob | None:
    """The tenant's job ``job_id``; None for another tenant's, like a missing one."""
    return BuildJob.objects.filter(tenant=tenant, pk=job_id).first()


def recent_jobs(tenant: Tenant, limit: int) -> list[BuildJob]:
    return list(BuildJob.objects.filter(tenant=tenant).order_by("-created_at")[:limit])


def claim_builds(server: str, slots: int, cap: int) -> list[BuildJob]:
    """Mark up to ``slots`` of the oldest queued jobs running for ``server``, never more
    than ``cap`` running over every server; returns them (tenant loaded)."""
    if slots <= 0:
        return []
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [CLAIM_LOCK])
            cursor.execute(_CLAIM_SQL, {"slots": slots, "cap": cap, "server": server})
            ids = [row[0] for row in cursor.fetchall()]
    if not ids:
        return []
    return list(BuildJob.objects.select_related("tenant").filter(pk__in=ids).order_by("created_at"))


def _running(job: BuildJob):
    """The job's row while it is still running under this very claim."""
    return BuildJob.objects.filter(
        pk=job.pk, state=BuildState.RUNNING, claimed_by=job.claimed_by, attempts=job.attempts
    )


def succeed_build(job: BuildJob, digest: str, new_artifact: bool, bytes_downloaded: int) -> bool:
    return (
        _running(job).update(
            state=BuildState.SUCCEEDED,
            digest=digest,
            new_artifact=new_artifact,
            bytes_downloaded=bytes_downloaded,
            finished_at=timezone.now(),
        )
        == 1
    )


def fail_build(job: BuildJob, kind: ErrorKind, detail: str, bytes_downloaded: int) -> bool:
    return (
        _running(job).update(
            state=BuildState.FAILED,
            error_kind=kind,
            detail=detail[:MAX_DETAIL_CHARS],
            bytes_downloaded=bytes_downloaded,
            finished_at=timezone.now(),
        )
        == 1
    )


def requeue_build(job: BuildJob, reason: str) -> bool:
    """Back to queued without using an attempt (this server is stopping, not the build failing)."""
    return (
        _running(job).update(
            state=BuildState.QUEUED,
            claimed_by="",
            attempts=max(0, job.attempts - 1),
            started_at=None,
            detail=reason[:MAX_DETAIL_CHARS],
        )
        == 1
    )


def recover_orphaned_builds(now=None) -> int:
    """Running jobs of servers that stopped or went silent: queued again, or failed once they
    have had their attempts. Returns how many were moved."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=server_registry.dead_after_s())
    stuck_s = wheels.PIP_TIMEOUT_S + STUCK_GRACE_S
    alive = set(
        ServerInstance.objects.filter(stopped_at__isnull=True, last_seen__gte=cutoff).values_list(
            "id", flat=True
        )
    )
    orphans = BuildJob.objects.filter(state=BuildState.RUNNING).filter(
        ~Q(claimed_by__in=alive)
        # A live server's thread that could not record an outcome (its database went away).
        | Q(started_at__lt=now - timedelta(seconds=stuck_s))
    )
    moved = 0
    for job in orphans:
        if job.claimed_by in alive:
            reason = f"server {job.claimed_by} recorded no outcome within {stuck_s:g} s"
        else:
            reason = f"server {job.claimed_by or '?'} stopped while running this build"
        if job.attempts >= MAX_BUILD_ATTEMPTS:
            detail = f"{reason}, after {job.attempts} attempts; not retried again"
            moved += fail_build(job, ErrorKind.INTERNAL, detail, job.bytes_downloaded)
        else:
            moved += _running(job).update(
                state=BuildState.QUEUED, claimed_by="", started_at=None, detail=reason
            )
    return moved


def release_builds_of(server: str, reason: str) -> int:
    """On a clean stop: this server's running jobs back to queued, their attempts given back."""
    released = 0
    for job in BuildJob.objects.filter(state=BuildState.RUNNING, claimed_by=server):
        released += requeue_build(job, reason)
    return released
