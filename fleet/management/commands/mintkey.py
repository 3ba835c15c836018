"""`manage.py mintkey --tenant NAME --role agent|read|write` / `mintkey --role admin`.

Prints the new key on stdout and nothing else, so scripts can capture it:
``KEY=$(python manage.py mintkey --tenant acme --role write)``.
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from fleet.models import ApiKey, Role, Tenant
from fleet.platform.schema import ensure_schema


class Command(BaseCommand):
    help = "Mint an API key and print it (shown once; only its hash is stored)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--tenant", default=None, help="tenant name (not for admin keys)")
        parser.add_argument("--role", required=True, choices=[r.value for r in Role])
        parser.add_argument("--label", default="", help="a note to recognise the key by")

    def handle(self, *args, **options) -> None:
        ensure_schema()
        role, tenant_name = options["role"], options["tenant"]
        if role == Role.ADMIN and tenant_name:
            raise CommandError("admin keys are platform-wide: drop --tenant")
        if role != Role.ADMIN and not tenant_name:
            raise CommandError(f"a {role} key belongs to a tenant: pass --tenant NAME")
        tenant = None
        if tenant_name:
            tenant = Tenant.objects.filter(name=tenant_name).first()
            if tenant is None:
                raise CommandError(
                    f"unknown tenant {tenant_name!r} (create it with: createtenant {tenant_name})"
                )
            if not tenant.is_active:
                raise CommandError(f"tenant {tenant_name!r} is deactivated")
        _, token = ApiKey.mint(role, tenant=tenant, label=options["label"] or f"cli:{role}")
        self.stdout.write(token)
