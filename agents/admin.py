"""Django admin for the agent roster: read-only (agents register themselves)."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from agents.models import Agent


@admin.register(Agent)
class AgentAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "tenant",
        "state",
        "target_triple",
        "version",
        "max_concurrency",
        "in_flight",
        "last_heartbeat",
        "connected_to",
        "managed_by",
    ]
    list_filter = ["state", "tenant", "target_triple", "managed_by"]
    search_fields = ["name", "tenant__name"]
    list_select_related = ["tenant"]
    # The key itself is shown by its lookup prefix only (ApiKey.__str__), never its hash.
    readonly_fields = ["api_key"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        return False
