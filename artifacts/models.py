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
    def task_ids(self) -> list[str]:
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
