"""Reconcile actual → desired for every tenant through the configured actuator.

Active tenants get ``reconcile(tenant, desired_count)``; a disabled tenant's
agents are stopped; so are the agents of a tenant that no longer exists
(found through the labels the actuator still manages).  One tenant's failure
is logged and never stops the others.
"""

from __future__ import annotations

import logging

from fleet.control.actuators.base import Actuator, ReconcileResult
from fleet.control.actuators.naming import tenant_label
from fleet.models import Tenant

log = logging.getLogger(__name__)


def reconcile_all(actuator: Actuator) -> list[ReconcileResult]:
    results: list[ReconcileResult] = []
    managed = actuator.managed_labels()
    known: set[str] = set()
    for tenant in Tenant.objects.all():
        label = tenant_label(tenant.name)
        known.add(label)
        try:
            if tenant.is_active:
                result = actuator.reconcile(tenant, tenant.desired_count)
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
