"""Reconcile actual → desired for every tenant through the configured actuator.

Active tenants get ``reconcile(tenant, pools)``: each agent pool's count and labels
(:func:`desired_pools`), never more than the tenant's effective limit in total (a count
above it is clamped first); a disabled tenant's
agents are stopped; so are the agents of a tenant that no longer exists
(found through the labels the actuator still manages).  One tenant's failure
is logged and never stops the others.
"""

from __future__ import annotations

import logging

from fleet.control.actuators.base import Actuator, PoolSpec, ReconcileResult
from fleet.control.actuators.naming import tenant_label
from fleet.control.limits import clamp_to_limits
from fleet.executors.fleet.routing import pool_match
from fleet.models import Tenant
from fleet.platform.config import get_config

log = logging.getLogger(__name__)


def desired_pools(tenant: Tenant, default_max: int) -> list[PoolSpec]:
    """Each pool's count and labels for the actuator: default first, then named pools.

    The clamp at the start of the pass already holds; the min()s keep a count raised since
    then (by a writer that ignored the limit) from ever reaching the substrate: the total
    never exceeds the limit, and named pools never take more than the total (newest pool
    first gives way, as a clamp would)."""
    total = min(tenant.desired_count, tenant.effective_limit(default_max))
    pools = pool_match.tenant_pools(tenant.pk)
    left = total
    named: list[PoolSpec] = []
    for pool in pools[1:]:
        take = min(pool.desired_count, left)
        named.append(PoolSpec.of(pool, take))
        left -= take
    return [PoolSpec.of(pools[0], left), *named]


def reconcile_all(actuator: Actuator, default_max: int | None = None) -> list[ReconcileResult]:
    """One pass over every tenant (``default_max``: the platform default limit, else config's)."""
    if default_max is None:
        default_max = get_config().default_max_agents
    clamp_to_limits(default_max)
    results: list[ReconcileResult] = []
    managed = actuator.managed_labels()
    known: set[str] = set()
    for tenant in Tenant.objects.all():
        label = tenant_label(tenant.name)
        known.add(label)
        try:
            if tenant.is_active:
                result = actuator.reconcile(tenant, desired_pools(tenant, default_max))
                results.append(result)
                if result.changed:
                    log.info(
                        "reconcile %s: desired %d, running %d → started %d, restarted %d, "
                        "draining %d",
                        tenant.name,
                        result.desired,
                        result.actual,
                        result.started,
                        result.restarted,
                        result.stopped,
                    )
            elif label in managed:
                stopped = actuator.stop_all(tenant)
                if stopped:
                    log.info(
                        "reconcile: tenant %s is disabled: stopping %d agent(s)", tenant, stopped
                    )
        except Exception:
            log.exception("reconcile of tenant %s through %s failed", tenant.name, actuator.name)
    for label in sorted(managed - known):
        try:
            stopped = actuator.stop_all(label)
            if stopped:
                log.info(
                    "reconcile: tenant %s no longer exists: stopping %d agent(s)", label, stopped
                )
        except Exception:
            log.exception("stopping the agents of deleted tenant %s failed", label)
    return results
