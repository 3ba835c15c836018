"""Agent pools: named groups of a tenant's agents started with the same labels.

Every tenant has a ``default`` pool.  Its count is not stored: it is whatever part of
the tenant's ``desired_count`` (the tenant total, CONTRACT.md's number) the named pools
do not hold, so everything that moves the tenant total (``/fleet/provision``, the admin
override, a clamp) moves the default pool exactly as before pools existed.  A named
pool stores its own ``desired_count``; the invariant Σ named ≤ tenant desired_count ≤
effective limit is kept by :mod:`fleet.control.limits` and :mod:`fleet.control.pools`.

An agent belongs to a named pool when its tags carry ``pool:<name>`` (the actuators add
it; a hand-run ``runagent --tags pool:gpu`` joins the pool too); agents without such a
tag belong to ``default``.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone

DEFAULT_POOL = "default"
POOL_TAG_PREFIX = "pool:"
# DNS-safe and short: it becomes part of process names, container names, Kubernetes
# Deployment names and the audit trail's ``field`` ("pool:<name>", 32 characters).
POOL_NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,22}[a-z0-9])?$"


def pool_tag(name: str) -> str:
    """The tag that marks an agent as a member of pool ``name``."""
    return POOL_TAG_PREFIX + name


class AgentPool(models.Model):
    tenant = models.ForeignKey("fleet.Tenant", on_delete=models.CASCADE, related_name="pools")
    name = models.CharField(max_length=24)
    # What the pool's agents are started with (runagent --tags / --capabilities).
    tags = models.JSONField(default=list, blank=True)
    capabilities = models.JSONField(default=list, blank=True)
    # Null: the platform's CLOACINA_AGENT_MAX_CONCURRENCY.
    max_concurrency = models.PositiveIntegerField(null=True, blank=True)
    # Container resources (docker, kubernetes); blank: the platform's CLOACINA_AGENT_* values.
    cpu = models.CharField(max_length=16, blank=True, default="")
    memory = models.CharField(max_length=16, blank=True, default="")
    gpu = models.PositiveIntegerField(default=0)  # GPUs per agent (nvidia.com/gpu)
    # Named pools only; the default pool's count is the tenant total minus the named pools'.
    desired_count = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["tenant", "id"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="uniq_pool_name"),
            models.CheckConstraint(
                condition=~models.Q(name=DEFAULT_POOL) | models.Q(desired_count=0),
                name="default_pool_count_derived",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id}/{self.name}"

    @property
    def is_default(self) -> bool:
        return self.name == DEFAULT_POOL

    def agent_tags(self) -> list[str]:
        """The tags its agents are started with: its own plus the membership tag."""
        own = list(self.tags or [])
        return own if self.is_default else [*own, pool_tag(self.name)]
