"""Where an idle pickup's time goes, hop by hop (``fleetbench --pickup-hops N``).

A real ``serve`` and real ``runagent`` processes run with ``CLOACINA_HOP_TRACE`` set
(:mod:`agents.protocol.hop_trace`): each marks the hops of every task it touches in one
file.  After an untimed warm-up (``WARMUP_PICKUPS``), N single-task executions are started one at
a time on the idle fleet (as fleetbench's idle phase does), and each task's path from its ``ready_at`` to its
``received_at`` is cut at the marks.  The table gives each hop's p50 / p90 / p99 and
the same for the whole path, so a change shows which hop it shortened.

Before the pickups it also times what one round trip and one committed (fsync'd) write
cost on this machine's database, the floor of any hop that waits for one.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from django.db import connection

from fleet.bench import workload
from fleet.bench.default import BENCH_TENANT, bench_tenant_key
from fleet.bench.fleet import AGENT_SLOTS, Agents, server_env
from fleet.bench.server import Api, BenchServer
from fleet.executors.fleet.delivery import db as delivery_db
from fleet.executors.fleet.state import ledger
from fleet.models import ApiKey, Tenant

TRACE_ENV = "CLOACINA_HOP_TRACE"
PROBE_ROUNDS = 200  # round trips / commits timed for the database's floor
# Untimed pickups first: each of the delivery pool's connections prepares the placement's
# statements after 2 runs and PostgreSQL plans them 5 more times before it keeps a generic
# plan, so the first ~7 per connection measure planning, not the steady state that
# fleetbench's idle phase (after its burst and drain) sees.
WARMUP_PICKUPS = 8 * delivery_db.POOL_THREADS
# The hops in path order: (name, mark that starts it — a trace hop or a row's column).
HOPS = (
    ("API: ready_at → its statement committed", "ready_at"),
    ("→ event on the dispatch loop", "submitted"),
    ("→ a dispatch worker has it", "loop_queued"),
    ("→ the placement starts (a delivery thread, or the loop)", "dispatching"),
    ("→ the placement answered (claim … COMMIT)", "placing"),
    ("→ back on the event loop", "committed"),
    ("→ work frame handed to the socket", "placed_on_loop"),
    ("→ the agent decoded it", "frame_sent"),
    ("→ the agent sent `received`", "agent_read"),
    ("→ the server read `received`", "agent_sent"),
    ("→ the confirmation's statement sent", "server_read"),
    ("→ received_at (the statement's now())", "confirming"),
)
END = "received_at"
# The placement's hop split, for the pickups placed in two round trips on a delivery thread
# (a "claimed" mark between; a lone placement in one statement on the loop has none).
TWO_TRIPS = (
    ("  (two trips) BEGIN + claim answered", "placing", "claimed"),
    ("  (two trips) reservation + COMMIT answered", "claimed", "committed"),
)


@dataclass
class HopTable:
    """Per hop the milliseconds of every sample; printed as fleetbench's table."""

    samples: int
    agents: int
    floor: dict[str, float]
    hops: dict[str, list[float]] = field(default_factory=dict)

    def table(self) -> str:
        head = (
            f"fleetbench: pickup hops, {self.samples} idle pickups, {self.agents} agents; "
            + ", ".join(f"{k} {v:.2f} ms" for k, v in self.floor.items())
        )
        rows = [("hop", "n", "p50_ms", "p90_ms", "p99_ms", "mean_ms")]
        for name, values in self.hops.items():
            rows.append((name, str(len(values)), *(_fmt(_pct(values, q)) for q in (50, 90, 99)),
                         _fmt(statistics.fmean(values) if values else float("nan"))))  # fmt: skip
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                           for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in rows]  # fmt: skip
        rule = "-" * len(lines[0])
        return "\n".join([head, rule, lines[0], rule, *lines[1:], rule])


def _pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def _fmt(value: float) -> str:
    return f"{value:.2f}"


def database_floor() -> dict[str, float]:
    """Median ms of a ``SELECT 1`` round trip and of a one-row INSERT committed on its own
    (autocommit: the commit waits for the WAL's fsync), on the bench database."""
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TABLE IF NOT EXISTS bench_commit_probe (id bigserial, at timestamptz)"
        )
        selects, inserts = [], []
        for _ in range(PROBE_ROUNDS):
            started = time.perf_counter()
            cursor.execute("SELECT 1")
            selects.append(time.perf_counter() - started)
            started = time.perf_counter()
            cursor.execute("INSERT INTO bench_commit_probe (at) VALUES (now())")
            inserts.append(time.perf_counter() - started)
        cursor.execute("DROP TABLE bench_commit_probe")
    return {
        "SELECT 1": statistics.median(selects) * 1000.0,
        "1-row INSERT committed": statistics.median(inserts) * 1000.0,
    }


def read_trace(path: Path) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """Each task's first time at each hop, and outbox id → task id (from ``frame_sent``)."""
    by_task: dict[str, dict[str, float]] = {}
    by_outbox: dict[str, dict[str, float]] = {}
    outbox_task: dict[str, str] = {}
    for line in path.read_text().splitlines():
        stamp, hop, task, outbox = line.split(" ")
        if hop.startswith("gc"):
            continue  # a process's collection, not a task's hop: gc_pauses() reads them
        if task != "-" and outbox != "-":
            outbox_task[outbox] = task
        marks = by_task.setdefault(task, {}) if task != "-" else by_outbox.setdefault(outbox, {})
        marks.setdefault(hop, float(stamp))
    for outbox, marks in by_outbox.items():
        task = outbox_task.get(outbox)
        if task is not None:
            for hop, stamp in marks.items():
                by_task.setdefault(task, {}).setdefault(hop, stamp)
    return by_task, outbox_task


def gc_pauses(path: Path, server_pid: int) -> dict[str, list[float]]:
    """The milliseconds of every traced garbage collection, by process and generation."""
    pauses: dict[str, list[float]] = {}
    for line in path.read_text().splitlines():
        _, hop, pid, ms = line.split(" ")
        if hop.startswith("gc"):
            who = "server" if pid == str(server_pid) else "agents"
            pauses.setdefault(f"{who}: a {hop} collection ≥ 0.5 ms", []).append(float(ms))
    return dict(sorted(pauses.items()))


def row_times(execution_ids: list[str]) -> dict[str, dict[str, float]]:
    """Each task's ``ready_at`` and its packet's ``received_at`` (epoch seconds)."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            SELECT t.id::text, EXTRACT(EPOCH FROM t.ready_at), EXTRACT(EPOCH FROM o.received_at)
            FROM fleet_taskexecution t
            JOIN {ledger.OUTBOX} o ON o.task_execution_id = t.id AND o.assignment = t.assignment
            WHERE t.workflow_execution_id = ANY(%s::uuid[]) AND o.received_at IS NOT NULL
            """,
            [execution_ids],
        )
        return {
            task: {"ready_at": float(ready), END: float(received)}
            for task, ready, received in cursor.fetchall()
        }


def hop_table(
    rows: dict[str, dict[str, float]], trace: dict[str, dict[str, float]]
) -> dict[str, list[float]]:
    """Per hop the ms of each task that has both of its marks; and the whole path."""
    hops: dict[str, list[float]] = {name: [] for name, _ in HOPS}
    hops.update({name: [] for name, _, _ in TWO_TRIPS})
    whole = hops["Ready → received_at (whole path)"] = []
    starts = [start for _, start in HOPS] + [END]
    for task, times in rows.items():
        marks = {**trace.get(task, {}), **times}
        whole.append((times[END] - times["ready_at"]) * 1000.0)
        for (name, start), end in zip(HOPS, starts[1:], strict=True):
            if start in marks and end in marks:
                hops[name].append((marks[end] - marks[start]) * 1000.0)
        # In order only: a later duplicate dispatch of a task placed in one trip (the
        # ready queue's event and the periodic scan's) marks "claimed" after it committed.
        if marks.get("placing", 1e300) <= marks.get("claimed", 0.0) <= marks.get("committed", 0.0):
            for name, start, end in TWO_TRIPS:
                hops[name].append((marks[end] - marks[start]) * 1000.0)
    return hops


def run_pickup_hops_bench(
    database_url: str, samples: int, agents: int, poll_s: float = 1.0
) -> HopTable:
    """``samples`` idle pickups on a traced fleet of ``agents`` (see the module docstring)."""
    key = bench_tenant_key()
    tenant = Tenant.objects.get(name=BENCH_TENANT)
    akey = ApiKey.mint("agent", tenant=tenant, label="fleetbench pickup hops")[1]
    home = Path(tempfile.mkdtemp(prefix="cloacina-pickup-hops-"))
    os.chmod(home, 0o711)
    trace = home / "hops.trace"
    floor = database_floor()
    os.environ[TRACE_ENV] = str(trace)  # the server and the agents inherit it
    try:
        with BenchServer(database_url, "fleet", **server_env(poll_s)) as server:
            api = Api(server.url, key)
            fleet = Agents(server.url, akey, agents, AGENT_SLOTS, home)
            server_pid = server.process.pid
            try:
                fleet.wait_connected()
                api.upload(workload.noop_package(workload.ONE_WORKFLOW, 1))
                workload.idle_pickups(api, WARMUP_PICKUPS)
                trace.write_text("")  # the warm-up's marks out
                execution_ids = workload.idle_pickups(api, samples)
            finally:
                api.close()
                fleet.stop()
        marks, _ = read_trace(trace)
        hops = hop_table(row_times(execution_ids), marks) | gc_pauses(trace, server_pid)
        result = HopTable(samples, agents, floor, hops)
    finally:
        del os.environ[TRACE_ENV]
    shutil.rmtree(home, ignore_errors=True)
    return result
