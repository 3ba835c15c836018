"""Django admin for packages, per-target artifacts and stored blobs: read-only.

Packages enter through the validated upload path (POST /api/v1/packages), never
through a form here; blob bytes are never rendered in a page.
"""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from artifacts.models import ArtifactBlob, PackageArtifact, WorkflowPackage


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        return False


class ArtifactInline(admin.TabularInline):
    model = PackageArtifact
    fields = ["target_triple", "content_hash", "size", "created_at"]
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj=None) -> bool:
        return False


@admin.register(WorkflowPackage)
class WorkflowPackageAdmin(ReadOnlyAdmin):
    list_display = [
        "name",
        "version",
        "tenant",
        "workflow_name",
        "kind",
        "host_triple",
        "size",
        "superseded",
        "built_at",
    ]
    list_filter = ["kind", "superseded", "tenant"]
    search_fields = ["name", "workflow_name", "digest", "tenant__name"]
    list_select_related = ["tenant"]
    inlines = [ArtifactInline]


@admin.register(PackageArtifact)
class PackageArtifactAdmin(ReadOnlyAdmin):
    list_display = ["package_name", "version", "tenant", "target_triple", "content_hash", "size"]
    list_filter = ["target_triple", "tenant"]
    search_fields = ["package_name", "content_hash"]
    list_select_related = ["tenant"]


@admin.register(ArtifactBlob)
class ArtifactBlobAdmin(ReadOnlyAdmin):
    list_display = ["digest", "size", "created_at"]
    search_fields = ["digest"]
    fields = ["digest", "size", "created_at"]  # never the bytes

    def get_queryset(self, request: HttpRequest):
        # Don't pull every blob's bytes out of the database to draw a list.
        return super().get_queryset(request).defer("data")
