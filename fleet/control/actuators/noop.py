"""CLOACINA_FLEET_ACTUATOR=none (the default): actuation is off; you run agents yourself."""

from __future__ import annotations

from collections.abc import Sequence

from fleet.control.actuators.base import (
    Actuator,
    AgentHandle,
    PoolSpec,
    ReconcileResult,
    label_of,
    pool_specs,
)
from fleet.models import Tenant


class NoopActuator(Actuator):
    name = "none"

    def actual(self, tenant: Tenant | str) -> list[AgentHandle]:
        return []

    def reconcile(self, tenant: Tenant, desired: int | Sequence[PoolSpec]) -> ReconcileResult:
        total = sum(spec.desired for spec in pool_specs(desired))
        return ReconcileResult(label_of(tenant), total, actual=0)

    def stop_all(self, tenant: Tenant | str) -> int:
        return 0

    def managed_labels(self) -> set[str]:
        return set()
