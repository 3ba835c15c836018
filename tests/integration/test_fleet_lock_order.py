"""The lock order (docs/fleet.md, "Lock order"): placement batches spanning many tenants
and result batches freeing slots all over the fleet, run at once from several
connections, never deadlock — PostgreSQL's own deadlock counter for the test database
(``pg_stat_database.deadlocks``) does not move."""

from __future__ import annotations

import uuid

import pytest

from agents.models import Agent
from fleet.bench.database import deadlocks
from fleet.bench.lock_race import run_race
from fleet.models import DeliveryOutbox, TaskExecution, Tenant
from tests.support.agents import make_agent
from tests.support.factories import make_package, start

SOURCE = "def noop(context):\n    return None\n"
TENANTS = 12
AGENTS_PER_TENANT = 6
WIDTH = 6  # tasks per execution, all Ready at once
ROUNDS = 4  # executions per tenant
PLACERS = 3
REPORTERS = 3
BATCH = 40
RACE_TIMEOUT_S = 240.0


@pytest.mark.django_db(transaction=True)
def test_multi_tenant_placement_and_result_batches_never_deadlock():
    tenants = [Tenant.objects.create(name=f"lock-order-{i}") for i in range(TENANTS)]
    ready: list[uuid.UUID] = []
    for tenant in tenants:
        tasks = [{"id": f"t{i}", "function": "demo.steps:noop"} for i in range(WIDTH)]
        make_package(tenant, tasks, SOURCE, name="wide", workflow="wide")
        for i in range(AGENTS_PER_TENANT):
            make_agent(tenant, f"{tenant.name}-a{i}", max_concurrency=3)
        for _ in range(ROUNDS):
            _execution, started = start(tenant, "wide", {})
            ready += [t.pk for t in started.values() if t.status == "Ready"]
    # Interleave the tenants in every batch: each placement batch spans many of them.
    ready.sort(key=str)
    expected = len(ready)
    assert expected == TENANTS * WIDTH * ROUNDS
    before = deadlocks()

    # Raises the first error of any racing thread.
    run_race(
        ready, placers=PLACERS, reporters=REPORTERS, batch=BATCH, timeout_s=RACE_TIMEOUT_S,
        claimer="server-1",
    )  # fmt: skip

    assert TaskExecution.objects.filter(status="Completed").count() == expected
    assert set(Agent.objects.values_list("in_flight", flat=True)) == {0}
    assert not DeliveryOutbox.objects.exclude(state="acked").exists()
    # Each racing thread flushed its backend's statistics (bench.database.flush_statistics).
    assert deadlocks() == before
