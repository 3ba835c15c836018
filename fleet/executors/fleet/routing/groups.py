"""Task groups: ``group = "name"`` keeps a group's tasks of one execution on one agent.

The binding itself is an :class:`~fleet.models.AffinityBinding` of kind ``group``
(:mod:`fleet.executors.fleet.routing.affinity`), keyed by execution and group name and tied to the
execution row; :func:`prune_finished` drops the bindings of finished executions.
"""

from __future__ import annotations

import uuid

from django.db import connection

from fleet.executors.fleet.routing.affinity import BindingKey
from fleet.models import BindingKind


def group_key(workflow_execution_id: uuid.UUID, group: str | None) -> BindingKey | None:
    if not group:
        return None
    return BindingKey(
        BindingKind.GROUP, f"group:{workflow_execution_id}:{group}"[:400], workflow_execution_id
    )


def prune_finished() -> int:
    """Delete group bindings of executions that reached a terminal state; return how many."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            DELETE FROM fleet_affinitybinding b USING fleet_workflowexecution e
            WHERE b.workflow_execution_id = e.id AND b.kind = 'group'
              AND e.status IN ('Completed', 'Failed', 'Cancelled')
            """
        )
        return cursor.rowcount
