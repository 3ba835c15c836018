"""Django admin for the platform: tenants and their fleet overrides, members, keys, records.

A tenant's limits (``max_agents_override``, ``desired_count``, ``max_backlog``,
``is_active``, ``storage_quota_bytes``) are changed only through the control plane
(:func:`fleet.control.limits.set_tenant_limits`), in the change form and the list's
inline edits alike, so the bounds are the same as everywhere else and every change
lands in the FleetChange audit trail with the admin user as actor and the form's
``reason``.  The Tenant admin has no bulk actions, so nothing bypasses it.

Keys never show their hash and cannot be added here (a token shown in a browser page
would end up in its history and caches): mint them with ``manage.py mintkey``; revoke
them here.
"""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.db import transaction
from django.http import HttpRequest

from artifacts.store import quota
from fleet.control import limits, pools
from fleet.executors.fleet.lifecycle import revoke_key
from fleet.management.commands.createtenant import TENANT_NAME, create_tenant
from fleet.models import (
    DEFAULT_POOL,
    AgentPool,
    ApiKey,
    AutoscaleDecision,
    DeliveryOutbox,
    Eviction,
    FleetChange,
    Schedule,
    Tenant,
    TenantMembership,
)
from fleet.schedules import service as schedules

LIMIT_FIELDS = limits.AUDITED_FIELDS


def admin_actor(request: HttpRequest) -> str:
    return f"admin:{request.user.get_username()}"


class ReadOnlyAdmin(admin.ModelAdmin):
    """Records written by the system: visible to the platform, never edited by hand."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        return False


class _DryRun(Exception):
    """Raised to roll back a validation-only call of the control plane."""


class TenantAdminForm(forms.ModelForm):
    reason = forms.CharField(
        required=False,
        max_length=limits.REASON_MAX_CHARS,
        help_text="why you change this tenant's limits (optional): kept in the audit trail",
    )

    class Meta:
        model = Tenant
        fields = [
            "name",
            "is_active",
            "max_agents_override",
            "desired_count",
            "max_backlog",
            "storage_quota_bytes",
        ]

    def clean_name(self) -> str:
        name = self.cleaned_data["name"]
        if not TENANT_NAME.fullmatch(name):
            raise forms.ValidationError(
                "use 1-63 lowercase letters, digits and '-', starting with a letter or digit"
            )
        return name

    def limit_changes(self) -> dict:
        """The limits this form changes (all of them the form holds, for a new tenant)."""
        held = [f for f in LIMIT_FIELDS if f in self.fields]
        if self.instance.pk:
            held = [f for f in held if f in self.changed_data]
        return {f: self.cleaned_data.get(f) for f in held}

    def reason_given(self) -> str:
        return self.cleaned_data.get("reason") or ""

    def clean(self) -> dict:
        cleaned = super().clean()
        changes = self.limit_changes()
        if self.instance.pk and changes and not self.errors:
            # Validate with the control plane's own rules by applying the change in a
            # savepoint and rolling it back; save_model then applies it for real.
            try:
                with transaction.atomic():
                    limits.set_tenant_limits(
                        Tenant.objects.get(pk=self.instance.pk),
                        "admin:validate",
                        self.reason_given(),
                        **changes,
                    )
                    raise _DryRun
            except _DryRun:
                pass
            except limits.FleetLimitError as exc:
                raise forms.ValidationError(exc.detail) from None
        return cleaned


class MembershipInline(admin.TabularInline):
    model = TenantMembership
    extra = 0
    autocomplete_fields = ["user"]


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    form = TenantAdminForm
    list_display = [
        "name",
        "is_active",
        "effective_limit_display",
        "max_agents_override",
        "desired_count",
        "created_at",
    ]
    list_editable = ["max_agents_override", "desired_count"]
    list_filter = ["is_active"]
    search_fields = ["name"]
    readonly_fields = ["created_at", "last_autoscaled_at", "storage_display"]
    inlines = [MembershipInline]

    @admin.display(description="storage used / quota")
    def storage_display(self, obj: Tenant) -> str:
        if obj.pk is None:
            return "-"
        limit, source = quota.storage_quota(obj)
        return f"{quota.storage_used(obj)} / {limit or 'unlimited'} bytes ({source})"

    def get_changelist_form(self, request: HttpRequest, **kwargs):
        # Inline edits in the list go through the same control-plane validation and save.
        kwargs.setdefault("form", TenantAdminForm)
        return super().get_changelist_form(request, **kwargs)

    @admin.display(description="effective limit")
    def effective_limit_display(self, obj: Tenant) -> int:
        return limits.effective_limit(obj)

    def get_readonly_fields(self, request: HttpRequest, obj=None):
        fields = list(super().get_readonly_fields(request, obj))
        if obj is None:
            # A new tenant gets its desired_count seeded (CLOACINA_INITIAL_AGENTS) like the CLI does.
            fields.append("desired_count")
        else:
            fields.append("name")  # the name is the tenant's identity in keys, slugs and URLs
        return fields

    def save_model(self, request: HttpRequest, obj: Tenant, form, change: bool) -> None:
        changes = form.limit_changes()
        if not change:
            # Created like the CLI does (seeded desired_count, audited as seed); the form's
            # other limits then go through the control plane like any change.
            tenant, _ = create_tenant(obj.name, changes.pop("max_agents_override", None))
            changes.pop("desired_count", None)  # read-only on the add form: the seed decides
            obj.pk = tenant.pk
        others = [
            f for f in form.changed_data if f not in LIMIT_FIELDS and f not in ("name", "reason")
        ]
        with transaction.atomic():
            if change and others:
                obj.save(update_fields=others)
            if changes:
                limits.set_tenant_limits(
                    Tenant.objects.get(pk=obj.pk),
                    admin_actor(request),
                    form.reason_given(),
                    **changes,
                )
        obj.refresh_from_db()
        if change and changes:
            messages.info(
                request,
                f"{obj.name}: {', '.join(sorted(changes))} changed (recorded in the audit trail)",
            )


@admin.register(TenantMembership)
class TenantMembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "tenant", "role"]
    list_filter = ["role", "tenant"]
    search_fields = ["user__username", "tenant__name"]
    autocomplete_fields = ["user", "tenant"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    # key_hash is never listed, shown or editable.
    list_display = ["lookup", "tenant", "role", "label", "created_at", "last_used_at", "status"]
    list_filter = ["role", "tenant", ("revoked_at", admin.EmptyFieldListFilter)]
    search_fields = ["lookup", "label", "tenant__name"]
    fields = ["lookup", "tenant", "role", "label", "created_at", "last_used_at", "revoked_at"]
    readonly_fields = ["lookup", "tenant", "role", "created_at", "last_used_at", "revoked_at"]
    actions = ["revoke"]

    @admin.display(description="status")
    def status(self, obj: ApiKey) -> str:
        return "revoked" if obj.revoked_at else "active"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # mint with `manage.py mintkey`: the token is shown once, on a terminal

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        return False  # revoke instead, so last_used_at and the audit stay

    @admin.action(description="Revoke selected keys")
    def revoke(self, request: HttpRequest, queryset) -> None:
        revoked = sum(1 for key in queryset if revoke_key(key))
        skipped = queryset.count() - revoked
        message = f"revoked {revoked} key(s)"
        if skipped:
            message += f"; {skipped} already revoked"
        self.message_user(request, message, messages.SUCCESS)


@admin.register(Eviction)
class EvictionAdmin(ReadOnlyAdmin):
    list_display = [
        "evicted_at",
        "tenant",
        "agent_name",
        "last_heartbeat",
        "in_flight",
        "reassigned",
        "reason",
    ]
    list_filter = ["tenant"]
    search_fields = ["agent_name"]
    date_hierarchy = "evicted_at"


@admin.register(DeliveryOutbox)
class DeliveryOutboxAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "tenant",
        "agent",
        "task_execution",
        "assignment",
        "state",
        "attempts",
        "created_at",
    ]
    list_filter = ["state", "tenant"]
    list_select_related = ["tenant", "agent", "task_execution"]
    # The payload carries the task's input context: tenant data, not shown in lists.
    exclude = ["payload"]


@admin.register(FleetChange)
class FleetChangeAdmin(ReadOnlyAdmin):
    list_display = ["at", "tenant", "field", "old_value", "new_value", "reason", "actor", "note"]
    list_filter = ["reason", "field", "tenant"]


@admin.register(AutoscaleDecision)
class AutoscaleDecisionAdmin(ReadOnlyAdmin):
    list_display = [
        "at",
        "tenant",
        "decision",
        "old_desired",
        "new_desired",
        "utilization",
        "backlog",
        "reason",
    ]
    list_filter = ["decision", "tenant"]


class AgentPoolAdminForm(forms.ModelForm):
    """Labels validated by the control plane's own rules (the same 422 messages as the API)."""

    class Meta:
        model = AgentPool
        fields = [
            "tenant",
            "name",
            "tags",
            "capabilities",
            "max_concurrency",
            "cpu",
            "memory",
            "gpu",
        ]

    def clean(self) -> dict:
        cleaned = super().clean()
        if self.errors:
            return cleaned
        try:
            if not self.instance.pk:
                pools.check_name(cleaned.get("name"))
            labels = {f: cleaned.get(f) for f in pools.LABEL_FIELDS if f in cleaned}
            cleaned.update(pools.check_labels(labels))
        except pools.FleetLimitError as exc:
            raise forms.ValidationError(exc.detail) from None
        return cleaned


@admin.register(AgentPool)
class AgentPoolAdmin(admin.ModelAdmin):
    """A tenant's agent pools; counts move one agent at a time through the control plane."""

    form = AgentPoolAdminForm
    list_display = ["tenant", "name", "pool_desired_count", "tags", "capabilities",
                    "max_concurrency", "cpu", "memory", "gpu"]  # fmt: skip
    list_filter = ["tenant"]
    search_fields = ["name", "tenant__name"]
    actions = ["provision_one", "deprovision_one"]

    @admin.display(description="desired_count")
    def pool_desired_count(self, obj: AgentPool) -> int:
        return pools.pool_state(obj.tenant, obj.name).desired_count

    def get_readonly_fields(self, request: HttpRequest, obj=None):
        return ["tenant", "name"] if obj is not None else []

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        return obj is None or not obj.is_default

    def save_model(self, request: HttpRequest, obj: AgentPool, form, change: bool) -> None:
        labels = {f: form.cleaned_data[f] for f in pools.LABEL_FIELDS if f in form.cleaned_data}
        if change:
            saved = pools.update_pool(obj.tenant, obj.name, labels)
        else:
            saved = pools.create_pool(obj.tenant, admin_actor(request), obj.name, labels)
        obj.pk = saved.pk

    def delete_model(self, request: HttpRequest, obj: AgentPool) -> None:
        pools.delete_pool(obj.tenant, obj.name, admin_actor(request))

    def delete_queryset(self, request: HttpRequest, queryset) -> None:
        for pool in queryset.exclude(name=DEFAULT_POOL):
            pools.delete_pool(pool.tenant, pool.name, admin_actor(request))

    def _step(self, request: HttpRequest, queryset, delta: int) -> None:
        for pool in queryset.select_related("tenant"):
            try:
                count = pools.step_pool(pool.tenant, pool.name, delta, admin_actor(request))
            except pools.FleetLimitError as exc:
                self.message_user(
                    request, f"{pool.tenant}/{pool.name}: {exc.detail}", messages.ERROR
                )
                continue
            self.message_user(
                request, f"{pool.tenant}/{pool.name}: desired_count {count - delta} → {count}"
            )

    @admin.action(description="Provision one agent in the selected pools")
    def provision_one(self, request: HttpRequest, queryset) -> None:
        self._step(request, queryset, +1)

    @admin.action(description="Deprovision one agent from the selected pools")
    def deprovision_one(self, request: HttpRequest, queryset) -> None:
        self._step(request, queryset, -1)


@admin.register(Schedule)
class ScheduleAdmin(ReadOnlyAdmin):
    """Every tenant's schedules; the platform may pause (and resume) any of them.  Their
    settings change through the tenant's API or its package's cloacina.toml."""

    list_display = (
        "tenant", "workflow", "cron", "timezone", "enabled", "source", "catchup", "overlap",
        "next_fire_at", "last_fire_at",
    )  # fmt: skip
    list_filter = ("enabled", "source", "tenant")
    search_fields = ("workflow", "tenant__name", "package_name")
    actions = ("pause", "resume")

    @admin.action(description="Pause the selected schedules")
    def pause(self, request: HttpRequest, queryset) -> None:
        changed = schedules.set_enabled(queryset, False)
        self.message_user(request, f"{changed} schedule(s) paused", messages.SUCCESS)

    @admin.action(description="Resume the selected schedules (fire times count from now)")
    def resume(self, request: HttpRequest, queryset) -> None:
        changed = schedules.set_enabled(queryset, True)
        self.message_user(request, f"{changed} schedule(s) resumed", messages.SUCCESS)
