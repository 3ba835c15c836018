"""A tenant's packages from the browser: upload, versions and per-target artifacts, builds,
and starting an execution with a JSON context editor.

Uploads go through :func:`artifacts.store.services.publish_package`, the service behind
``POST /api/v1/packages`` (same validation, same refusals, same size limit, checked
before the file is read); starts through :func:`fleet.api.starts.start`, the rules of
``POST /api/v1/workflows/{workflow}/executions``.  Read-only members see the lists and
no form; the server refuses their posts (403) anyway.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse

from artifacts.builds import jobs as build_jobs
from artifacts.store import queries, services
from fleet.api import starts
from fleet.console.access import get_rw_tenant_for_user, get_tenant_for_user
from fleet.console.reruns import parse_context
from fleet.console.responses import (
    ConsoleError,
    action_done_go_to,
    console_view,
    refusals_answered,
)
from fleet.models import Tenant
from fleet.platform.config import get_config
from fleet.schedules import declared

PACKAGES_SHOWN = 200  # versions on the page, newest first per name; GET /api/v1/packages lists all
BUILDS_SHOWN = 20


def _lists(tenant: Tenant) -> dict:
    packages = list(queries.packages_for(tenant)[:PACKAGES_SHOWN])
    for package in packages:
        package.targets = sorted(package.artifacts.all(), key=lambda a: a.target_triple)
    builds = build_jobs.recent_jobs(tenant, BUILDS_SHOWN)
    return {
        "packages": packages,
        "total": queries.packages_for(tenant).count(),
        "shown": PACKAGES_SHOWN,
        "workflows": sorted({p.workflow_name for p in packages if not p.superseded}),
        "builds": builds,
        "builds_active": any(b.active for b in builds),
    }


def _context(request: HttpRequest, name: str) -> dict:
    tenant, can_write = get_tenant_for_user(request, name)
    config = get_config()
    return {
        "tenant": tenant,
        "can_write": can_write,
        "max_package_bytes": config.max_package_bytes,
        "max_context_bytes": config.max_context_bytes,
        **_lists(tenant),
    }


@console_view()
def packages(request: HttpRequest, name: str) -> HttpResponse:
    return render(request, "console/packages.html", _context(request, name))


@console_view()
def packages_table(request: HttpRequest, name: str) -> HttpResponse:
    return render(request, "console/partials/packages_table.html", _context(request, name))


@console_view(methods=["POST"])
def upload(request: HttpRequest, name: str) -> HttpResponse:
    """Publish the uploaded archive; then the page again, with a line naming the version."""
    tenant = get_rw_tenant_for_user(request, name)
    file = request.FILES.get("file")
    if file is None:
        raise ConsoleError("choose a package file (.tar.gz or .zip) to upload", 400)
    with refusals_answered():
        services.refuse_oversized_upload(file.size)  # before reading it into memory
        package, created = services.publish_package(
            tenant, file.read(), on_published=declared.sync_declared
        )
    what = "published" if created else "already stored (same content)"
    # The page again, not a partial refresh: the start form lists the new workflow.
    return action_done_go_to(
        request,
        f"{package.name} {package.version} {what}: workflow {package.workflow_name}, "
        f"tasks {', '.join(package.task_names)}",
        reverse("console:packages", args=[tenant.name]),
    )


@console_view(methods=["POST"])
def start_execution(request: HttpRequest, name: str) -> HttpResponse:
    """Start the chosen workflow with the editor's context; then the execution's page."""
    tenant = get_rw_tenant_for_user(request, name)
    workflow = request.POST.get("workflow", "").strip()
    if not workflow:
        raise ConsoleError("choose a workflow to start", 400)
    text = request.POST.get("context", "").strip()
    context = parse_context(text) if text else {}
    with refusals_answered():
        execution = starts.start(tenant, workflow, context)
    return action_done_go_to(
        request,
        f"execution {str(execution.pk)[:8]} of {workflow} started",
        reverse("console:execution", args=[execution.pk]),
    )
