"""`manage.py fleetbench --lock-order-tenants T`: the dispatch hot path's own statements —
placement batches and result batches, several of each at once on their own connections
— with the same agents and tasks spread over 1 tenant and then over T tenants.

No server and no sockets: placer threads place Ready tasks with
:func:`~fleet.executors.fleet.delivery.batch_placement.place_tasks` (batches spanning
the tenants) and reporter threads report each open packet a success with
:func:`~fleet.executors.fleet.result_intake.apply_results`, until every task has
completed.  What is measured is what the tenant count changes: the row locks of the
agents, workflows and tasks those transactions take (docs/fleet.md, "Lock order").
Each kind of phase runs twice, in the order 1, T, T, 1, each on an emptied database.
Printed per kind: tasks/s, and the deadlocks PostgreSQL detected
(``pg_stat_database.deadlocks`` for the bench database, before and after each phase);
then the T-tenant throughput as a share of the 1-tenant one.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from django.core.management import call_command
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from agents.models import Agent, AgentState
from agents.protocol.triples import host_triple
from artifacts.store.services import publish_package
from fleet.bench import workload
from fleet.bench.database import deadlocks
from fleet.bench.lock_race import completed_tasks, run_race
from fleet.engine.scheduler import start_execution
from fleet.executors.fleet import lifecycle
from fleet.executors.fleet.delivery import local_sockets
from fleet.models import TaskExecution, Tenant

WORKFLOW = "lock_order_wide"
BATCH = 64  # tasks per placement batch, results per result batch
BEAT_EVERY_S = 5.0  # the agents stay within the liveness window however long a phase runs
PHASE_TIMEOUT_S = 600.0


@dataclass
class LockPhase:
    tenants: int
    tasks: int
    wall_s: float
    deadlocks: int

    @property
    def throughput(self) -> float:
        return self.tasks / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class LockOrderResult:
    agents: int
    phases: list[LockPhase]

    def table(self) -> str:
        lines = [f"placement + result batches, {self.agents} agents, no sockets"]
        lines.append(f"{'tenants':>8} {'tasks':>7} {'wall s':>8} {'tasks/s':>9} {'deadlocks':>10}")
        for p in self.phases:
            lines.append(
                f"{p.tenants:>8} {p.tasks:>7} {p.wall_s:>8.2f} {p.throughput:>9.1f} "
                f"{p.deadlocks:>10}"
            )
        one, many = self.phases[0], self.phases[-1]
        if len(self.phases) > 1 and one.throughput:
            lines.append(
                f"{many.tenants} tenants vs 1: {100 * many.throughput / one.throughput:.0f} % "
                "of the single-tenant throughput"
            )
        return "\n".join(lines)


def _setup(prefix: str, tenants: int, agents: int, tasks: int, width: int) -> list[uuid.UUID]:
    """``tenants`` tenants sharing ``agents`` agents and ``tasks`` Ready tasks evenly; the
    Ready task ids, interleaved across the tenants (sorted by id)."""
    archive = workload.noop_package(WORKFLOW, width)
    server = local_sockets.server_id()
    ready: list[uuid.UUID] = []
    executions = max(1, tasks // (width * tenants))
    for t in range(tenants):
        tenant = Tenant.objects.create(name=f"{prefix}-{t}")
        publish_package(tenant, archive)
        Agent.objects.bulk_create(
            Agent(
                tenant=tenant, name=f"{prefix}-{t}-a{i}", state=AgentState.LIVE,
                target_triple=host_triple(), max_concurrency=4, connected_to=server,
                last_heartbeat=timezone.now(),
            )
            for i in range(max(1, agents // tenants))
        )  # fmt: skip
        for _ in range(executions):
            with transaction.atomic():
                execution = start_execution(tenant, WORKFLOW, {})
            ready += list(
                TaskExecution.objects.filter(
                    workflow_execution=execution, status="Ready"
                ).values_list("id", flat=True)
            )
    return sorted(ready, key=str)


def _beat(tenant_ids: list[int]) -> None:
    """Keep the agents within the liveness window.  A beat that loses a deadlock (with a
    build whose lock order is broken: the phase counts it) is simply tried again later."""
    agents = list(Agent.objects.filter(tenant_id__in=tenant_ids).values_list("id", "tenant_id"))
    try:
        with connection.cursor() as cursor:  # the sockets' batched beat (id order)
            cursor.execute(
                lifecycle.BEAT_MANY,
                {
                    "ids": [a for a, _t in agents],
                    "tenants": [t for _a, t in agents],
                    "has": [False] * len(agents),
                    "metrics": ["{}"] * len(agents),
                    "draining": [False] * len(agents),
                },
            )
    except DatabaseError:
        pass


def _phase(tenants: int, agents: int, tasks: int, width: int, placers: int, reporters: int):
    prefix = f"lo{tenants}-{uuid.uuid4().hex[:6]}"
    ready = _setup(prefix, tenants, agents, tasks, width)
    tenant_ids = list(Tenant.objects.filter(name__startswith=prefix).values_list("id", flat=True))
    last_beat = [0.0]

    def beat(elapsed: float) -> None:
        if elapsed - last_beat[0] > BEAT_EVERY_S:
            _beat(tenant_ids)
            last_beat[0] = elapsed

    before = deadlocks()
    wall = run_race(
        ready, placers=placers, reporters=reporters, batch=BATCH, timeout_s=PHASE_TIMEOUT_S,
        claimer="lock-order-bench", every_tick=beat,
    )  # fmt: skip
    return LockPhase(tenants, completed_tasks(), wall, deadlocks() - before)


def run_lock_order_bench(
    tenants: int, agents: int, tasks: int, width: int, placers: int = 3, reporters: int = 3
) -> LockOrderResult:
    """Phases with everything in one tenant and with it spread over ``tenants``, in the
    order 1, T, T, 1 (each on an emptied database: a phase after another runs slower on
    its rows), the two of each kind summed."""
    order = [1, tenants, tenants, 1] if tenants > 1 else [1, 1]
    runs: dict[int, list[LockPhase]] = {}
    for count in order:
        call_command("flush", interactive=False, verbosity=0)
        runs.setdefault(count, []).append(_phase(count, agents, tasks, width, placers, reporters))
    phases = [
        LockPhase(
            count,
            sum(p.tasks for p in done),
            sum(p.wall_s for p in done),
            sum(p.deadlocks for p in done),
        )
        for count, done in runs.items()
    ]
    return LockOrderResult(agents, phases)
