"""`manage.py createconsoleuser USERNAME (--tenant NAME --role read|write | --superuser)`.

Creates (or updates) a console login.  Tenant members see only their tenant;
``--superuser`` makes a platform admin.  The password comes from the first
line of stdin with ``--password-stdin``; otherwise a random one is generated
and printed once.
"""

from __future__ import annotations

import secrets
import sys

from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from fleet.models import Role, Tenant, TenantMembership
from fleet.platform.schema import ensure_schema


class Command(BaseCommand):
    help = "Create or update a console user: a tenant member, or a platform admin."

    def add_arguments(self, parser) -> None:
        parser.add_argument("username")
        parser.add_argument("--tenant", default=None)
        parser.add_argument("--role", default=None, choices=[Role.READ.value, Role.WRITE.value])
        parser.add_argument("--superuser", action="store_true", help="a platform admin")
        parser.add_argument("--email", default="")
        parser.add_argument(
            "--password-stdin", action="store_true", help="read the password from stdin"
        )

    def handle(self, *args, **options) -> None:
        ensure_schema()
        username, tenant_name, role = options["username"], options["tenant"], options["role"]
        if options["superuser"] and (tenant_name or role):
            raise CommandError("--superuser is platform-wide: drop --tenant/--role")
        if not options["superuser"] and not (tenant_name and role):
            raise CommandError("pass --tenant NAME --role read|write, or --superuser")
        tenant = None
        if tenant_name:
            tenant = Tenant.objects.filter(name=tenant_name).first()
            if tenant is None:
                raise CommandError(f"unknown tenant {tenant_name!r}")
        password, generated = self._password(options["password_stdin"])
        User = get_user_model()
        with transaction.atomic():
            user, created = User.objects.get_or_create(
                username=username, defaults={"email": options["email"]}
            )
            if password is not None and (created or options["password_stdin"]):
                try:
                    validate_password(password, user)
                except ValidationError as exc:
                    raise CommandError(f"password rejected: {' '.join(exc.messages)}") from None
                user.set_password(password)
            if options["superuser"]:
                user.is_staff = user.is_superuser = True
            user.save()
            if tenant is not None:
                TenantMembership.objects.update_or_create(
                    user=user, tenant=tenant, defaults={"role": role}
                )
        what = "platform admin" if options["superuser"] else f"{role} member of {tenant_name}"
        self.stdout.write(f"{'created' if created else 'updated'} console user {username} ({what})")
        if created and generated:
            self.stdout.write(f"password: {password}")

    def _password(self, from_stdin: bool) -> tuple[str | None, bool]:
        if from_stdin:
            line = sys.stdin.readline().rstrip("\r\n")
            if not line:
                raise CommandError("--password-stdin: no password on stdin")
            return line, False
        return secrets.token_urlsafe(12), True
