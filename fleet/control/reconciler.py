"""Reconcile actual → desired for every tenant through the configured actuator.

Active tenants get ``reconcile(tenant, desired_count)``, never more than the
tenant's effective limit (a count above it is clamped first); a disabled tenant's
agents are stopped; so are the agents of a tenant that no longer exists
(found through the labels the actuator still manages).  One tenant's failure
is logged and never stops the others.
"""

from __future__ import annotations

import logging

from fleet.control.actuators.base import Actuator, ReconcileResult
from fleet.control.actuators.naming import tenant_label
from fleet.control.limits import clamp_to_limits
from fleet.models import Tenant
from fleet.platform.config import get_config

log = logging.getLogger(__name__)


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
                # The clamp above already holds; min() keeps a count raised since then (by a
                # writer that ignored the limit) from ever reaching the substrate.
                desired = min(tenant.desired_count, tenant.effective_limit(default_max))
                result = actuator.reconcile(tenant, desired)
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
