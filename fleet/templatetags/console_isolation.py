"""The console's tenant-isolation banner (cloacina_site/isolation.py says when it shows)."""

from __future__ import annotations

from django import template

from cloacina_site.isolation import current_warning
from fleet.console.access import is_platform_admin

register = template.Library()


@register.simple_tag
def isolation_warning(user) -> str:
    """The warning for a platform admin, "" for anyone else (they can do nothing about it)."""
    if not is_platform_admin(user):
        return ""
    return current_warning() or ""
