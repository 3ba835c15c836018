"""REST endpoints of this app (mounted under /api/v1 by cloacina_site.api).

Thin: each view authenticates (which sets ``request.tenant``), calls one
service or query scoped by that tenant, and shapes the answer.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Literal

from django.http import HttpRequest, HttpResponse
from ninja import Field, File, Form, Router, Schema, Status, UploadedFile
from ninja.errors import HttpError

from agents.protocol.triples import MAX_TRIPLE_CHARS, TRIPLE_PATTERN
from artifacts.builds import jobs as build_jobs
from artifacts.models import BuildJob, PackageArtifact, WorkflowPackage
from artifacts.store import queries, services, wheels
from fleet.api.error_status import http_status
from fleet.platform.auth import agent_auth, read_auth, write_auth
from fleet.schedules import declared

router = Router(tags=["packages"])

# parse_triple's rule (and its clearer message) as the schema publishes it.
TRIPLE_SCHEMA = {"pattern": TRIPLE_PATTERN, "maxLength": MAX_TRIPLE_CHARS}
TRIPLE_FIELD = Field(json_schema_extra=TRIPLE_SCHEMA)


class ErrorOut(Schema):
    detail: str


class PackageOut(Schema):
    name: str
    version: str
    digest: str
    kind: str
    workflow: str
    tasks: list[str]
    superseded: bool
    host_triple: str


class ArtifactRef(Schema):
    target_triple: str
    digest: str


class PackageListItem(Schema):
    name: str
    version: str
    kind: str
    workflow: str
    digest: str
    superseded: bool
    built_at: datetime
    artifacts: list[ArtifactRef]


class TargetArtifactOut(Schema):
    package: str
    version: str
    target_triple: str
    digest: str


class BuildJobOut(Schema):
    id: uuid.UUID
    status_url: str
    state: Literal["queued", "running", "succeeded", "failed"]
    package: str
    version: str
    target_triple: str
    digest: str | None = Field(None, description="the built artifact, once succeeded")
    new_artifact: bool | None = Field(
        None, description="false: identical to the build already stored for the triple"
    )
    detail: str | None = Field(None, description="why it failed (or was queued again)")
    error_status: int | None = Field(
        None, description="the HTTP status that fits the failure (422, 413, 502, 504, …)"
    )
    bytes_downloaded: int
    attempts: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class TargetBuildIn(Schema):
    target_triple: str = Field(..., json_schema_extra=TRIPLE_SCHEMA)


ERRORS = {400: ErrorOut, 401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 409: ErrorOut}
UPLOAD_ERRORS = {**ERRORS, 413: ErrorOut, 422: ErrorOut}


def _read_upload(file: UploadedFile) -> bytes:
    services.refuse_oversized_upload(file.size)  # before reading it into memory
    return file.read()


def _package_out(package: WorkflowPackage) -> dict:
    return {
        "name": package.name,
        "version": package.version,
        "digest": package.digest,
        "kind": package.kind,
        "workflow": package.workflow_name,
        "tasks": package.task_names,
        "superseded": package.superseded,
        "host_triple": package.host_triple,
    }


@router.post(
    "/packages",
    auth=write_auth,
    response={200: PackageOut, 201: PackageOut, **UPLOAD_ERRORS},
    summary="Upload, validate and build a workflow package",
)
def upload_package(request: HttpRequest, file: File[UploadedFile]):
    """201 for a new version, 200 when this exact content is already stored for it."""
    package, created = services.publish_package(
        request.tenant, _read_upload(file), on_published=declared.sync_declared
    )
    return Status(201 if created else 200, _package_out(package))


@router.get("/packages", auth=read_auth, response={200: list[PackageListItem], **ERRORS})
def list_packages(request: HttpRequest):
    return [
        {
            "name": p.name,
            "version": p.version,
            "kind": p.kind,
            "workflow": p.workflow_name,
            "digest": p.digest,
            "superseded": p.superseded,
            "built_at": p.built_at,
            "artifacts": [
                {"target_triple": a.target_triple, "digest": a.content_hash}
                for a in sorted(p.artifacts.all(), key=lambda a: a.target_triple)
            ],
        }
        for p in queries.packages_for(request.tenant)
    ]


def _artifact_out(artifact: PackageArtifact) -> dict:
    return {
        "package": artifact.package_name,
        "version": artifact.version,
        "target_triple": artifact.target_triple,
        "digest": artifact.content_hash,
    }


@router.post(
    "/packages/{name}/{version}/artifacts",
    auth=write_auth,
    response={200: TargetArtifactOut, 201: TargetArtifactOut, **UPLOAD_ERRORS},
    summary="Upload a per-target build of a native package",
)
def upload_target_artifact(
    request: HttpRequest,
    name: str,
    version: str,
    file: File[UploadedFile],
    target_triple: Form[Annotated[str, TRIPLE_FIELD]],
    digest: Form[str | None] = None,
):
    """``digest``, if sent, must be the sha256 of the uploaded file (integrity check)."""
    artifact, created = services.publish_target_artifact(
        request.tenant, name, version, target_triple, _read_upload(file), digest=digest
    )
    return Status(201 if created else 200, _artifact_out(artifact))


def _build_out(job: BuildJob) -> dict:
    return {
        "id": job.pk,
        "status_url": build_jobs.status_url(job),
        "state": job.state,
        "package": job.package_name,
        "version": job.version,
        "target_triple": job.target_triple,
        "digest": job.digest or None,
        "new_artifact": job.new_artifact,
        "detail": job.detail or None,
        "error_status": http_status(job.error_kind) if job.error_kind else None,
        "bytes_downloaded": job.bytes_downloaded,
        "attempts": job.attempts,
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
    }


@router.post(
    "/packages/{name}/{version}/builds",
    auth=write_auth,
    response={202: BuildJobOut, **UPLOAD_ERRORS},
    summary="Queue a per-target build of a native package (vendored platform wheels)",
)
def build_target_artifact(request: HttpRequest, name: str, version: str, body: TargetBuildIn):
    """Checks the request at once (404/422), then queues the build and answers 202 with its
    ``status_url``; the server runs ``pip download`` for the target's platform tags over the
    package's requirements.txt in the background (see docs/packages.md). One build per
    tenant at a time: the same build again joins the queued or running one (202, same
    ``id``), another build is a 409 until it finishes."""
    build_jobs.refuse_if_busy(request.tenant, name, version, body.target_triple)
    build = wheels.prepare_build(request.tenant, name, version, body.target_triple)
    job, _ = build_jobs.enqueue_build(request.tenant, build.package, body.target_triple)
    return Status(202, _build_out(job))


@router.get(
    "/builds/{build_id}",
    auth=read_auth,
    response={200: BuildJobOut, **ERRORS},
    summary="A build's state: queued, running, succeeded (with the digest) or failed (why)",
)
def get_build(request: HttpRequest, build_id: uuid.UUID):
    job = build_jobs.job_for(request.tenant, build_id)
    if job is None:
        raise HttpError(404, f"no build {build_id} in this tenant")
    return _build_out(job)


@router.get(
    "/artifacts/{digest}",
    auth=agent_auth,
    response={200: None, **ERRORS},
    summary="Download an artifact of the key's tenant by digest",
    openapi_extra={
        "responses": {
            200: {
                "description": "the artifact's bytes (a package archive)",
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                },
            }
        }
    },
)
def download_artifact(request: HttpRequest, digest: str):
    data = queries.artifact_bytes(request.tenant, digest)
    if data is None:
        raise HttpError(404, f"no artifact {digest} in this tenant")
    response = HttpResponse(data, content_type="application/octet-stream")
    response["X-Content-SHA256"] = digest
    response["Content-Length"] = str(len(data))
    response["Content-Disposition"] = f'attachment; filename="{digest}.tar.gz"'
    return response
