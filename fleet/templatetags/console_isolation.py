"""The console's tenant-isolation banner (fleet/platform/isolation.py says when it shows)."""

from __future__ import annotations

from django import template

from fleet.console.access import is_platform_admin
from fleet.platform.isolation import current_warning

register = template.Library()


@register.simple_tag
def isolation_warning(user) -> str:
    """The warning for a platform admin, "" for anyone else (they can do nothing about it)."""
    if not is_platform_admin(user):
        return ""
    return current_warning() or ""
