"""Who may see and change what in the console.

Every console view goes through these helpers, so the permission rules live in
one tested place: a tenant member sees only its tenants (role read or write) that
are active — a deactivated tenant's members lose it at once, like its keys and
sockets — and a platform admin (a Django superuser) sees and may change every tenant.  Another
tenant's object is answered with 404, never 403, so its existence is not leaked.
"""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404, HttpRequest

from fleet.models import Role, Tenant, TenantMembership, WorkflowExecution


def is_platform_admin(user: AbstractBaseUser | AnonymousUser) -> bool:
    return bool(user.is_authenticated and user.is_superuser and user.is_active)


def tenants_for_user(user: AbstractBaseUser | AnonymousUser) -> QuerySet[Tenant]:
    """The tenants ``user`` may see, ordered by name."""
    if is_platform_admin(user):
        return Tenant.objects.all().order_by("name")
    if not user.is_authenticated:
        return Tenant.objects.none()
    return Tenant.objects.filter(memberships__user=user, is_active=True).order_by("name").distinct()


def writable_tenant_ids(user: AbstractBaseUser | AnonymousUser) -> set[int] | None:
    """Ids of the tenants ``user`` may change; None means every tenant (platform admin)."""
    if is_platform_admin(user):
        return None
    if not user.is_authenticated:
        return set()
    return set(
        TenantMembership.objects.filter(
            user=user, role=Role.WRITE, tenant__is_active=True
        ).values_list("tenant_id", flat=True)
    )


def get_tenant_for_user(request: HttpRequest, name: str) -> tuple[Tenant, bool]:
    """The tenant named ``name`` and whether the user may change it; 404 if not visible."""
    user = request.user
    if is_platform_admin(user):
        tenant = Tenant.objects.filter(name=name).first()
        if tenant is None:
            raise Http404(f"no tenant named {name!r}")
        return tenant, True
    membership = (
        TenantMembership.objects.select_related("tenant")
        .filter(user=user, tenant__name=name, tenant__is_active=True)
        .first()
        if user.is_authenticated
        else None
    )
    if membership is None:
        raise Http404(f"no tenant named {name!r}")
    return membership.tenant, membership.role == Role.WRITE


def get_rw_tenant_for_user(request: HttpRequest, name: str) -> Tenant:
    """The tenant, if the user may change it: 404 if not visible, 403 if read-only."""
    tenant, can_write = get_tenant_for_user(request, name)
    if not can_write:
        raise PermissionDenied(f"your role in tenant {tenant.name!r} is read-only")
    return tenant


def require_platform_admin(request: HttpRequest) -> None:
    if not is_platform_admin(request.user):
        raise PermissionDenied("only a platform admin may do this")


def get_execution_for_user(request: HttpRequest, execution_id) -> tuple[WorkflowExecution, bool]:
    """The execution and whether the user may change it; 404 unless its tenant is visible."""
    execution = (
        WorkflowExecution.objects.select_related("tenant", "package")
        .filter(pk=execution_id, tenant__in=tenants_for_user(request.user))
        .first()
    )
    if execution is None:
        raise Http404("no such execution")
    writable = writable_tenant_ids(request.user)
    return execution, writable is None or execution.tenant_id in writable
