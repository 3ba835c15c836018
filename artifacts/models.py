"""Workflow packages, their per-target builds, and the content-addressed blob store."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class ArtifactBlob(models.Model):
    """Content-addressed bytes (sha256 hex).  In the database so every server replica sees them."""

    digest = models.CharField(max_length=64, primary_key=True)
    size = models.PositiveBigIntegerField()
    data = models.BinaryField()
    created_at = models.DateTimeField(default=timezone.now)


class PackageKind(models.TextChoices):
    PYTHON = "python"
    NATIVE = "native"


class WorkflowPackage(models.Model):
    """The primary (host-arch) build of a package version (table ``workflow_packages``)."""

    tenant = models.ForeignKey("fleet.Tenant", on_delete=models.CASCADE, related_name="packages")
    name = models.CharField(max_length=100)
    version = models.CharField(max_length=64)
    kind = models.CharField(max_length=8, choices=PackageKind.choices, default=PackageKind.PYTHON)
    workflow_name = models.CharField(max_length=200)
    digest = models.CharField(max_length=64)  # -> ArtifactBlob.digest
    size = models.PositiveBigIntegerField(default=0)
    host_triple = models.CharField(max_length=100)
    manifest = models.JSONField()  # the validated cloacina.toml, normalised
    superseded = models.BooleanField(default=False)
    built_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "workflow_packages"
        ordering = ["name", "-built_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "name", "version"], name="uniq_package_version"
            )
        ]
        indexes = [
            models.Index(fields=["tenant", "workflow_name", "superseded"]),
            # GET /artifacts/{digest} checks the digest belongs to the caller's tenant.
            models.Index(fields=["tenant", "digest"], name="package_tenant_digest_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.name}=={self.version}"

    @property
    def task_names(self) -> list[str]:
        return [task["id"] for task in self.manifest.get("tasks", [])]


class PackageArtifact(models.Model):
    """An extra per-target build of a native package (table ``package_artifacts``)."""

    tenant = models.ForeignKey(
        "fleet.Tenant", on_delete=models.CASCADE, related_name="package_artifacts"
    )
    package = models.ForeignKey(WorkflowPackage, on_delete=models.CASCADE, related_name="artifacts")
    package_name = models.CharField(max_length=100)
    version = models.CharField(max_length=64)
    target_triple = models.CharField(max_length=100)
    content_hash = models.CharField(max_length=64)  # -> ArtifactBlob.digest
    size = models.PositiveBigIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "package_artifacts"
        constraints = [
            models.UniqueConstraint(
                fields=["package_name", "version", "tenant", "target_triple"],
                name="uniq_artifact_per_target",
            ),
        ]
        indexes = [
            models.Index(fields=["tenant", "content_hash"], name="artifact_tenant_digest_idx"),
        ]


class BuildState(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


ACTIVE_BUILD_STATES = (BuildState.QUEUED, BuildState.RUNNING)


class BuildJob(models.Model):
    """A server-side per-target build (``POST .../builds``), run in the background by
    :mod:`artifacts.builds.runner` (table ``package_build_jobs``).

    Durable so a server restart loses none: a job left ``running`` by a dead server is
    queued again (or failed once it has had its attempts). At most one queued or running
    job per tenant, enforced by a partial unique index.
    """

    id = models.UUIDField(primary_key=True)
    tenant = models.ForeignKey("fleet.Tenant", on_delete=models.CASCADE, related_name="build_jobs")
    package = models.ForeignKey(
        WorkflowPackage, on_delete=models.CASCADE, related_name="build_jobs"
    )
    package_name = models.CharField(max_length=100)
    version = models.CharField(max_length=64)
    target_triple = models.CharField(max_length=100)
    state = models.CharField(max_length=10, choices=BuildState.choices, default=BuildState.QUEUED)
    detail = models.TextField(blank=True, default="")  # why it failed, in the API's words
    # Why it failed, by kind (fleet.platform.errors.ErrorKind); the API and console show its HTTP status.
    error_kind = models.CharField(max_length=20, blank=True, default="")
    digest = models.CharField(max_length=64, blank=True, default="")  # the built artifact
    new_artifact = models.BooleanField(null=True)  # False: identical to the stored build
    bytes_downloaded = models.PositiveBigIntegerField(default=0)
    attempts = models.PositiveSmallIntegerField(default=0)
    claimed_by = models.CharField(max_length=100, blank=True, default="")  # server instance
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True)
    finished_at = models.DateTimeField(null=True)

    class Meta:
        db_table = "package_build_jobs"
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant"],
                condition=models.Q(state__in=["queued", "running"]),
                name="one_active_build_per_tenant",
            )
        ]
        indexes = [
            # The claim: the oldest queued jobs; the recovery sweep: running ones.
            models.Index(
                fields=["state", "created_at"],
                name="build_job_state_idx",
                condition=models.Q(state__in=["queued", "running"]),
            ),
            models.Index(fields=["tenant", "-created_at"], name="build_job_tenant_idx"),
        ]

    def __str__(self) -> str:
        return f"build {self.package_name}=={self.version} for {self.target_triple}: {self.state}"

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_BUILD_STATES
