"""`manage.py createtenant NAME [--max-agents N]`: create a tenant (idempotent)."""

from __future__ import annotations

import re

from django.core.management.base import BaseCommand, CommandError
from django.db import IntegrityError, transaction

from fleet.models import DEFAULT_POOL, AgentPool, ChangeReason, FleetChange, Tenant
from fleet.platform.config import get_config
from fleet.platform.schema import ensure_schema

TENANT_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
ACTOR = "cli:createtenant"


def validate_tenant_name(name: str) -> str:
    if not TENANT_NAME.fullmatch(name):
        raise CommandError(
            f"invalid tenant name {name!r}: use 1-63 lowercase letters, digits and '-', "
            "starting with a letter or digit"
        )
    return name


def create_tenant(name: str, max_agents: int | None = None) -> tuple[Tenant, bool]:
    """The tenant ``name`` and whether it was created now (an existing one is left unchanged)."""
    existing = Tenant.objects.filter(name=name).first()
    if existing is not None:
        return existing, False
    config = get_config()
    try:
        with transaction.atomic():
            tenant = Tenant.objects.create(name=name, max_agents_override=max_agents)
            seed = min(config.initial_agents, tenant.effective_limit(config.default_max_agents))
            tenant.desired_count = seed
            tenant.save(update_fields=["desired_count"])
            changes = [
                FleetChange(
                    tenant=tenant, field="desired_count", old_value=None, new_value=seed,
                    reason=ChangeReason.SEED, actor=ACTOR,
                )
            ]  # fmt: skip
            if max_agents is not None:
                changes.append(
                    FleetChange(
                        tenant=tenant, field="max_agents_override", old_value=None,
                        new_value=max_agents, reason=ChangeReason.SEED, actor=ACTOR,
                    )
                )  # fmt: skip
            FleetChange.objects.bulk_create(changes)
            # Its default pool (docs/control-plane.md, "Agent pools"): holds the seeded count.
            AgentPool.objects.create(tenant=tenant, name=DEFAULT_POOL)
    except IntegrityError:  # created concurrently by someone else: still idempotent
        return Tenant.objects.get(name=name), False
    return tenant, True


class Command(BaseCommand):
    help = "Create a tenant; an existing tenant is reported and left unchanged."

    def add_arguments(self, parser) -> None:
        parser.add_argument("name", help="tenant name: [a-z0-9][a-z0-9-]{0,62}")
        parser.add_argument(
            "--max-agents",
            type=int,
            default=None,
            help="platform override of the tenant's agent ceiling (default: CLOACINA_DEFAULT_MAX_AGENTS)",
        )

    def handle(self, *args, **options) -> None:
        ensure_schema()
        name = validate_tenant_name(options["name"])
        max_agents = options["max_agents"]
        if max_agents is not None and max_agents < 0:
            raise CommandError(f"--max-agents must be >= 0, got {max_agents}")
        tenant, created = create_tenant(name, max_agents)
        if not created:
            self.stdout.write(f"tenant {name} already exists")
            return
        self.stdout.write(
            f"created tenant {name} (effective agent limit {tenant.effective_limit()}, "
            f"desired_count {tenant.desired_count})"
        )
