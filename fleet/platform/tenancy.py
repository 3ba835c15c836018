"""Tenants, their console members and their API keys."""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets

from django.conf import settings
from django.db import connection, models
from django.utils import timezone

from fleet.platform.config import get_config


class Tenant(models.Model):
    """The isolation boundary: packages, executions, agents and keys belong to one."""

    name = models.CharField(max_length=63, unique=True)
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)
    # Control plane: the platform admin's ceiling override and the operational target.
    max_agents_override = models.PositiveIntegerField(null=True, blank=True)
    desired_count = models.PositiveIntegerField(default=0)
    last_autoscaled_at = models.DateTimeField(null=True, blank=True)
    # Overflow protection: 0 means unlimited Ready/NotStarted backlog.
    max_backlog = models.PositiveIntegerField(default=0)
    # Bytes of packages and per-target builds it may store: null = the platform's
    # CLOACINA_TENANT_STORAGE_BYTES, 0 = unlimited (artifacts/store/quota.py).
    storage_quota_bytes = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        help_text="bytes of packages and per-target builds this tenant may store; empty: the "
        "platform default (CLOACINA_TENANT_STORAGE_BYTES), 0: unlimited",
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def effective_limit(self, default_max_agents: int | None = None) -> int:
        """The hard ceiling on agents: the override if set, else the platform default."""
        if self.max_agents_override is not None:
            return self.max_agents_override
        if default_max_agents is None:
            default_max_agents = get_config().default_max_agents
        return default_max_agents


class Role(models.TextChoices):
    AGENT = "agent"
    READ = "read"
    WRITE = "write"
    ADMIN = "admin"


class TenantMembership(models.Model):
    """A console user's role in a tenant (platform admins are Django superusers)."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(
        max_length=8, choices=[(Role.READ, "read"), (Role.WRITE, "write")], default=Role.READ
    )

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "tenant"], name="uniq_membership")]


KEY_PREFIX = "clk"


def hash_secret(secret: str) -> str:
    # Keys are 256-bit random tokens, so a fast hash is enough: there is nothing to brute-force.
    return hashlib.sha256(secret.encode()).hexdigest()


class ApiKey(models.Model):
    """A bearer token: shown once at mint, stored as a SHA-256 hash, scoped to tenant + role."""

    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="keys"
    )
    role = models.CharField(max_length=8, choices=Role.choices)
    lookup = models.CharField(max_length=16, unique=True)
    key_hash = models.CharField(max_length=64)
    label = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["tenant", "role"])]

    def __str__(self) -> str:
        owner = self.tenant.name if self.tenant_id else "platform"
        return f"{self.role} key {self.lookup}… ({owner})"

    # Revoking a key also retires the agents registered with it: that is the agents
    # layer's service, fleet.executors.fleet.lifecycle.revoke_key (tenancy imports nothing above it).

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None and (self.tenant_id is None or self.tenant.is_active)

    @classmethod
    def mint(cls, role: str, tenant: Tenant | None = None, label: str = "") -> tuple[ApiKey, str]:
        """Create a key; return it with the plaintext token (never stored)."""
        if role == Role.ADMIN and tenant is not None:
            raise ValueError("admin keys are platform-wide and take no tenant")
        if role != Role.ADMIN and tenant is None:
            raise ValueError(f"a {role} key needs a tenant")
        lookup = secrets.token_hex(6)
        secret = secrets.token_urlsafe(32)
        token = f"{KEY_PREFIX}_{lookup}_{secret}"
        key = cls.objects.create(
            tenant=tenant, role=role, lookup=lookup, key_hash=hash_secret(token), label=label
        )
        return key, token

    @classmethod
    def verify(cls, token: str) -> ApiKey | None:
        """The active key for ``token``, or None.  Compares hashes in constant time."""
        parts = token.split("_", 2)
        if len(parts) != 3 or parts[0] != KEY_PREFIX:
            return None
        key = _key_by_lookup(parts[1])
        if key is None or not hmac.compare_digest(key.key_hash, hash_secret(token)):
            return None
        if not key.is_active:
            return None
        return key


def _key_by_lookup(lookup: str) -> ApiKey | None:
    """The key whose ``lookup`` is given, with its tenant (None: no such key).

    Every request of an agent verifies its key (agent keys are not cached: revocation is
    immediate), so this is the statement ``select_related("tenant")`` would run, written
    once: compiling that query was a good share of a registration's CPU.
    """
    key_fields, tenant_fields, sql = _key_query()
    with connection.cursor() as cursor:
        cursor.execute(sql, [lookup])  # lookup is unique: at most one row
        row = cursor.fetchone()
    if row is None:
        return None
    split = len(key_fields)
    key = ApiKey.from_db(connection.alias, key_fields, row[:split])
    # A platform (admin) key has no tenant: the LEFT JOIN's columns are all NULL.
    key.tenant = (
        Tenant.from_db(connection.alias, tenant_fields, row[split:]) if key.tenant_id else None
    )
    return key


@functools.cache
def _key_query() -> tuple[list[str], list[str], str]:
    keys, tenants = ApiKey._meta.concrete_fields, Tenant._meta.concrete_fields
    columns = [f"k.{f.column}" for f in keys] + [f"t.{f.column}" for f in tenants]
    sql = (
        f"SELECT {', '.join(columns)} FROM {ApiKey._meta.db_table} k "
        f"LEFT JOIN {Tenant._meta.db_table} t ON t.id = k.tenant_id WHERE k.lookup = %s"
    )
    return [f.attname for f in keys], [f.attname for f in tenants], sql
