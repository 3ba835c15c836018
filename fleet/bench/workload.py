"""The benchmark workload: no-op packages, bursts and idle pickups, and what is measured.

Everything measured comes from the database rows the server wrote, not from
the client's clock: throughput is tasks / (last ``finished_at`` − first
``ready_at``) and dispatch latency is ``started_at − ready_at`` (Ready → the
claim that started the run).
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from django.db import connection, transaction

from artifacts.store.testing import build_archive, manifest_toml
from fleet.bench.server import Api
from fleet.engine.scheduler import start_execution
from fleet.models import Tenant

WIDE_WORKFLOW = "noop_wide"
ONE_WORKFLOW = "noop_one"
SUBMIT_THREADS = 4
WAIT_TIMEOUT_S = 600.0
NOOP_SOURCE = "def noop(context):\n    return None\n"


def noop_package(workflow: str, width: int) -> bytes:
    """A package of ``width`` independent no-op tasks (workflow ``workflow``)."""
    tasks = [{"id": f"t{i:04d}", "function": "bench.steps:noop"} for i in range(width)]
    return build_archive(
        {
            "cloacina.toml": manifest_toml(
                tasks, name=workflow.replace("_", "-"), workflow=workflow
            ),
            "workflow/bench/__init__.py": "",
            "workflow/bench/steps.py": NOOP_SOURCE,
        }
    )


@dataclass
class PhaseResult:
    name: str
    tasks: int
    wall_s: float
    latencies_ms: list[float] = field(default_factory=list)
    failed: int = 0
    cpu: dict[str, float] = field(default_factory=dict)  # process group -> CPU seconds used

    @property
    def throughput(self) -> float:
        return self.tasks / self.wall_s if self.wall_s > 0 else 0.0

    def percentile(self, q: float) -> float:
        if not self.latencies_ms:
            return float("nan")
        if len(self.latencies_ms) == 1:
            return self.latencies_ms[0]
        return statistics.quantiles(self.latencies_ms, n=100, method="inclusive")[int(q) - 1]


@dataclass
class BenchResult:
    executor: str
    settings: dict
    phases: list[PhaseResult]

    def table(self) -> str:
        head = f"fleetbench: executor={self.executor} " + " ".join(
            f"{k}={v}" for k, v in self.settings.items()
        )
        header = ("phase", "tasks", "failed", "wall_s", "tasks/s", "p50_ms", "p95_ms", "p99_ms")
        rows = [header + ("server_cpu_ms/task", "db_cpu_ms/task")]
        for p in self.phases:
            rows.append(
                (
                    p.name,
                    str(p.tasks),
                    str(p.failed),
                    f"{p.wall_s:.2f}",
                    f"{p.throughput:.0f}",
                    f"{p.percentile(50):.1f}",
                    f"{p.percentile(95):.1f}",
                    f"{p.percentile(99):.1f}",
                    _per_task(p, "server"),
                    _per_task(p, "database"),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [_row(r, widths) for r in rows]
        rule = "-" * len(lines[0])
        return "\n".join([head, rule, lines[0], rule, *lines[1:], rule])


def _per_task(phase: PhaseResult, group: str) -> str:
    if group not in phase.cpu or not phase.tasks:
        return "-"
    return f"{phase.cpu[group] * 1000.0 / phase.tasks:.2f}"


def _row(cells: tuple[str, ...], widths: list[int]) -> str:
    # First column left-aligned (names), numbers right-aligned.
    return "  ".join(
        cell.rjust(width) if i else cell.ljust(width)
        for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
    )


def wait_finished(execution_ids: list[str], poll_s: float = 0.05) -> None:
    """Block until every execution is terminal (read from the database)."""
    deadline = time.monotonic() + WAIT_TIMEOUT_S
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM fleet_workflowexecution WHERE id = ANY(%s::uuid[]) "
                "AND status NOT IN ('Completed', 'Failed', 'Cancelled')",
                [execution_ids],
            )
            if cursor.fetchone()[0] == 0:
                return
        time.sleep(poll_s)
    raise RuntimeError(f"executions not finished after {WAIT_TIMEOUT_S}s")


def measure(name: str, execution_ids: list[str]) -> PhaseResult:
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT count(*), count(*) FILTER (WHERE status <> 'Completed'),
                   EXTRACT(EPOCH FROM max(finished_at) - min(ready_at))
            FROM fleet_taskexecution WHERE workflow_execution_id = ANY(%s::uuid[])
            """,
            [execution_ids],
        )
        tasks, failed, wall_s = cursor.fetchone()
        cursor.execute(
            """
            SELECT EXTRACT(EPOCH FROM started_at - ready_at) * 1000.0
            FROM fleet_taskexecution
            WHERE workflow_execution_id = ANY(%s::uuid[]) AND started_at IS NOT NULL
            """,
            [execution_ids],
        )
        latencies = sorted(float(row[0]) for row in cursor.fetchall())
    return PhaseResult(name, int(tasks), float(wall_s or 0.0), latencies, int(failed))


def burst(api_factory, executions: int, workflow: str = WIDE_WORKFLOW) -> list[str]:
    """Start ``executions`` executions as fast as the API takes them (a few client threads)."""
    per_thread = [executions // SUBMIT_THREADS + (i < executions % SUBMIT_THREADS) for i in range(SUBMIT_THREADS)]  # fmt: skip

    def submit(count: int) -> list[str]:
        api: Api = api_factory()
        try:
            return [api.start(workflow) for _ in range(count)]
        finally:
            api.close()

    with ThreadPoolExecutor(SUBMIT_THREADS) as pool:
        batches = list(pool.map(submit, [n for n in per_thread if n]))
    connection.close()  # this thread's connection is separate from the pool's; nothing to keep
    return [execution_id for batch in batches for execution_id in batch]


def paced(api: Api, executions: int, per_second: float, workflow: str = WIDE_WORKFLOW) -> list[str]:
    """Start ``executions`` executions at a steady ``per_second`` (one client): load below
    capacity, so Ready → started is the dispatch path under load, not a backlog's queue."""
    ids: list[str] = []
    started = time.monotonic()
    for i in range(executions):
        delay = started + i / per_second - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        ids.append(api.start(workflow))
    return ids


# The peers' trickle (../shared/peers/client.py, TRICKLE_GAP): one task every 20 ms.
IDLE_GAP_S = 0.02


def idle_pickups(api: Api, samples: int, workflow: str = ONE_WORKFLOW) -> list[str]:
    """One single-task execution at a time on an idle server, sent as the peers' trickle
    sends its tasks: one start, then ``IDLE_GAP_S`` with the client asleep.

    The client used to poll the database every 2 ms from the start until the execution was
    done.  On two cores that poll ran while the server and the agent were waking for the
    pickup it measured (round i17-startplace: a frame that left as the client woke took the
    agent 0.72 ms to read, against 0.37 ms), and the peers' client does not poll then.  Each
    start still waits for the last execution to be done, checked after the gap (a no-op
    task is done long before), so every pickup finds the server idle."""
    ids: list[str] = []
    for _ in range(samples):
        execution_id = api.start(workflow)
        time.sleep(IDLE_GAP_S)
        wait_finished([execution_id], poll_s=IDLE_GAP_S / 4)
        ids.append(execution_id)
    return ids


def queue_executions(tenant_name: str, workflow: str, executions: int) -> list[str]:
    """Start ``executions`` executions in ONE transaction (the same scheduler code the API
    runs), so every task turns Ready at the same instant: the executor alone sets the pace."""
    tenant = Tenant.objects.get(name=tenant_name)
    with transaction.atomic():
        return [str(start_execution(tenant, workflow, {}).id) for _ in range(executions)]


def drain_wall_s(execution_ids: list[str]) -> float:
    """First claim to last finish: the wall time of pre-queued work."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXTRACT(EPOCH FROM max(finished_at) - min(started_at)) FROM fleet_taskexecution "
            "WHERE workflow_execution_id = ANY(%s::uuid[])",
            [execution_ids],
        )
        return float(cursor.fetchone()[0] or 0.0)


def measure_drain(name: str, execution_ids: list[str]) -> PhaseResult:
    """:func:`measure`, the clock starting at the first claim (pre-queued work)."""
    phase = measure(name, execution_ids)
    phase.wall_s = drain_wall_s(execution_ids)
    return phase
