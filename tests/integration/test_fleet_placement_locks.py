"""A placement locks only the agents its slots can go to (fleet/executors/fleet/state/ledger.py,
RESERVE_AND_ENQUEUE and CLAIM_AND_RESERVE): every candidate is ranked on a read without a
lock, and only a tenant's first ``wanted`` + SPARE_AGENTS of that ranking are locked.

Locked rows are counted by their ``xmax``: a row lock stays in the row's header after the
locking transaction ends, until the row is next written (the version a placement wrote
carries its lock too); a row nobody locked has none."""

from __future__ import annotations

from collections import Counter

import pytest
from django.db import connection

from fleet.executors.fleet.delivery.batch_placement import place_tasks
from fleet.executors.fleet.delivery.placement import Placed
from fleet.executors.fleet.state.ledger import SPARE_AGENTS
from tests.integration.test_fleet_batch_placement import ready_tasks, wide_package
from tests.integration.test_fleet_one_trip import one_task, place_on_loop
from tests.support.agents import make_agent

pytestmark = pytest.mark.django_db(transaction=True)

AGENTS = 20  # more than a few tasks plus the spare agents


def locked(tenant) -> int:
    """The tenant's agent rows that were locked (and perhaps written)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM agents_agent WHERE tenant_id = %s AND xmax::text <> '0'",
            [tenant.id],
        )
        return cursor.fetchone()[0]


def test_a_batch_locks_only_the_agents_its_tasks_can_be_dealt_to(tenant, other_tenant):
    wide_package(tenant, 3)
    for i in range(AGENTS):
        make_agent(tenant, f"a{i:02d}", max_concurrency=4)
    make_agent(other_tenant, "theirs", max_concurrency=4)
    ids = ready_tasks(tenant)
    placed = place_tasks(ids, "server-1")
    assert all(isinstance(p, Placed) for p in placed.values())
    # The dealing is unchanged: one slot per agent while all have the same room.
    assert sorted(Counter(p.agent_id for p in placed.values()).values()) == [1, 1, 1]
    # Locked: the 3 agents written and at most SPARE_AGENTS more — not all 20.
    assert locked(tenant) <= 3 + SPARE_AGENTS
    assert locked(other_tenant) == 0


def test_a_lone_placement_locks_only_its_best_agents(tenant):
    for i in range(AGENTS):
        make_agent(tenant, f"a{i:02d}", max_concurrency=4)
    task = one_task(tenant)
    placed = place_on_loop(task, tenant.id)
    assert isinstance(placed, Placed)
    assert locked(tenant) <= 1 + SPARE_AGENTS
