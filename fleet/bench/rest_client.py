"""`fleetbench --client rest`: the figures a user script sees from outside.

Each simulated user (``--clients`` of them, default 1) submits one execution at a time over
REST and polls ``GET /executions/{id}`` until it is terminal, then submits the next, on one
keep-alive connection, as a plain script would.  Measured:

* throughput by the server's own timestamps (tasks / (last ``finished_at`` − first
  ``ready_at``), as every other phase) and by the client's clock (tasks / the time from the
  first POST to the last "done" a user saw: polling included);
* each execution's round trip as a user sees it (POST sent → terminal status read);
* the server's CPU per request for ``POST /workflows/{w}/executions`` and
  ``GET /executions/{id}``, on the idle server after the run: GET is ``K`` reads of a
  finished execution (the idle server's own CPU over the same time subtracted); POST is
  ``K`` executions started over REST minus the same ``K`` started in the database (what
  running them costs), so what is left is the request.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from fleet.bench import workload
from fleet.bench.cpu import CpuMeter
from fleet.bench.default import BENCH_TENANT, bench_tenant_key
from fleet.bench.fleet import AGENT_SLOTS, Agents
from fleet.bench.server import Api, BenchServer
from fleet.models import ApiKey, Tenant

TERMINAL = frozenset({"Completed", "Failed", "Cancelled"})
REQUEST_SAMPLES = 200  # requests timed on the idle server, per kind
EXECUTION_TIMEOUT_S = 300.0  # one execution, polled by one user


def option_errors(executions: int, clients: int, poll_interval_s: float) -> list[str]:
    """What is wrong with the phase's options (empty when they are usable)."""
    errors = []
    if clients < 1:
        errors.append(f"--clients must be >= 1, got {clients}")
    elif clients > executions:
        errors.append(
            f"--clients ({clients}) must not exceed the executions (--tasks / --width = {executions})"
        )
    if poll_interval_s < 0:
        errors.append(f"--rest-poll-interval must be >= 0, got {poll_interval_s:g}")
    return errors


@dataclass
class UserLog:
    """What one simulated user did and saw (client clock: ``time.monotonic``)."""

    execution_ids: list[str] = field(default_factory=list)
    post_ms: list[float] = field(default_factory=list)
    get_ms: list[float] = field(default_factory=list)
    round_trip_ms: list[float] = field(default_factory=list)
    first_post_at: float = 0.0
    last_done_at: float = 0.0


@dataclass
class RequestCost:
    """One kind of request: its client-side latencies and the server CPU it cost."""

    name: str
    count: int
    latencies_ms: list[float]
    server_cpu_ms: float | None  # per request; None when not measured

    def percentile(self, q: int) -> float:
        if not self.latencies_ms:
            return float("nan")
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


@dataclass
class RestClientResult:
    """The phases (server clock, client clock) and the per-request costs, as one table."""

    bench: workload.BenchResult
    requests: list[RequestCost]

    def table(self) -> str:
        header = ("request", "count", "p50_ms", "p95_ms", "server_cpu_ms/request")
        rows = [header]
        for r in self.requests:
            cpu = "-" if r.server_cpu_ms is None else f"{r.server_cpu_ms:.2f}"
            rows.append(
                (r.name, str(r.count), f"{r.percentile(50):.1f}", f"{r.percentile(95):.1f}", cpu)
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = [
            "  ".join(
                cell.rjust(width) if i else cell.ljust(width)
                for i, (cell, width) in enumerate(zip(row, widths, strict=True))
            )
            for row in rows
        ]
        rule = "-" * len(lines[0])
        return "\n".join([self.bench.table(), rule, lines[0], rule, *lines[1:], rule])


def run_user(api: Api, workflow: str, count: int, poll_interval_s: float) -> UserLog:
    """Start ``count`` executions one after another, each polled until terminal."""
    log = UserLog(first_post_at=time.monotonic())
    for _ in range(count):
        sent = time.monotonic()
        execution_id = api.start(workflow)
        log.post_ms.append((time.monotonic() - sent) * 1000.0)
        log.execution_ids.append(execution_id)
        deadline = sent + EXECUTION_TIMEOUT_S
        while True:
            asked = time.monotonic()
            response = api.client.get(f"/executions/{execution_id}")
            log.get_ms.append((time.monotonic() - asked) * 1000.0)
            if response.status_code != 200:
                raise RuntimeError(f"GET execution: {response.status_code} {response.text}")
            if response.json()["status"] in TERMINAL:
                break
            if asked > deadline:
                raise RuntimeError(
                    f"execution {execution_id} not done after {EXECUTION_TIMEOUT_S}s"
                )
            time.sleep(poll_interval_s)
        log.last_done_at = time.monotonic()
        log.round_trip_ms.append((log.last_done_at - sent) * 1000.0)
    return log


def run_users(
    url: str, key: str, workflow: str, executions: int, clients: int, poll_interval_s: float
) -> list[UserLog]:
    """``clients`` users in parallel threads sharing ``executions`` between them."""
    shares = [executions // clients + (i < executions % clients) for i in range(clients)]

    def user(count: int) -> UserLog:
        api = Api(url, key)
        try:
            return run_user(api, workflow, count, poll_interval_s)
        finally:
            api.close()

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(user, shares))


def get_cost(server_pid: int, api: Api, execution_id: str, samples: int) -> RequestCost:
    """``samples`` GETs of one finished execution on the idle server; the server's CPU per
    request, less what the idle server spends over the same wall time."""
    meter = CpuMeter(server_pid)
    idle_before, started = meter.sample(), time.monotonic()
    latencies = []
    for _ in range(samples):
        asked = time.monotonic()
        response = api.client.get(f"/executions/{execution_id}")
        latencies.append((time.monotonic() - asked) * 1000.0)
        if response.status_code != 200:
            raise RuntimeError(f"GET execution: {response.status_code} {response.text}")
    busy = meter.used(idle_before, meter.sample())["server"]
    wall = time.monotonic() - started
    idle = _idle_cpu(meter, wall)
    return RequestCost("GET execution (idle)", samples, latencies, (busy - idle) * 1000.0 / samples)


def _idle_cpu(meter: CpuMeter, wall_s: float) -> float:
    """The server's CPU seconds over ``wall_s`` of doing nothing (its background loops)."""
    before = meter.sample()
    threading.Event().wait(wall_s)
    return meter.used(before, meter.sample())["server"]


def post_cost(server_pid: int, api: Api, workflow: str, samples: int) -> RequestCost:
    """``samples`` executions started over REST, less the same started in the database:
    both are run to the end, so the difference is what the POSTs themselves cost."""
    meter = CpuMeter(server_pid)
    before = meter.sample()
    latencies, ids = [], []
    for _ in range(samples):
        sent = time.monotonic()
        ids.append(api.start(workflow))
        latencies.append((time.monotonic() - sent) * 1000.0)
    workload.wait_finished(ids)
    over_rest = meter.used(before, before := meter.sample())["server"]
    workload.wait_finished(workload.queue_executions(BENCH_TENANT, workflow, samples))
    in_database = meter.used(before, meter.sample())["server"]
    return RequestCost(
        "POST start (idle)", samples, latencies, (over_rest - in_database) * 1000.0 / samples
    )


def _fleet_agents(url: str, agents: int) -> tuple[Agents, Path]:
    """``agents`` runagent processes of the bench tenant, in a private home."""
    tenant, _ = Tenant.objects.get_or_create(name=BENCH_TENANT)
    key = ApiKey.mint("agent", tenant=tenant, label="fleetbench --client rest agents")[1]
    home = Path(tempfile.mkdtemp(prefix="cloacina-fleetbench-rest-"))
    os.chmod(home, 0o711)  # the agents' task user passes through to the caches
    fleet = Agents(url, key, agents, AGENT_SLOTS, home)
    fleet.wait_connected()
    return fleet, home


def run_rest_client_bench(
    database_url: str,
    executor: str,
    tasks: int,
    width: int,
    clients: int = 1,
    poll_interval_s: float = 0.01,
    agents: int = 2,
    workers: int = 4,
    poll_s: float = 1.0,
) -> RestClientResult:
    """The whole phase on a fresh server (see the module docstring)."""
    key = bench_tenant_key()
    executions = max(1, tasks // width)
    env = {"CLOACINA_WORKER_PROCESSES": str(workers), "CLOACINA_SCHEDULER_POLL_S": str(poll_s)}
    fleet, home = None, None
    with BenchServer(database_url, executor, **env) as server:
        api = Api(server.url, key)
        try:
            if executor == "fleet":
                fleet, home = _fleet_agents(server.url, agents)
            api.upload(workload.noop_package(workload.WIDE_WORKFLOW, width))
            # Warm-up: workers or agents import the package once before anything is timed.
            workload.wait_finished([api.start(workload.WIDE_WORKFLOW) for _ in range(4)])
            meter = CpuMeter(server.process.pid)
            before = meter.sample()
            users = run_users(
                server.url, key, workload.WIDE_WORKFLOW, executions, clients, poll_interval_s
            )
            cpu = meter.used(before, meter.sample())
            ids = [i for user in users for i in user.execution_ids]
            by_server = workload.measure("rest (server clock)", ids)
            by_server.cpu = cpu
            by_client = _client_clock(users, by_server)
            samples = min(REQUEST_SAMPLES, executions)
            costs = [
                post_cost(server.process.pid, api, workload.WIDE_WORKFLOW, samples),
                get_cost(server.process.pid, api, ids[-1], samples),
                _under_load("POST start (run)", users, "post_ms"),
                _under_load("GET execution (run)", users, "get_ms"),
            ]
        finally:
            api.close()
            if fleet is not None:
                fleet.stop()
    if home is not None:
        shutil.rmtree(home, ignore_errors=True)  # the agents' caches; kept if the run failed
    settings = {
        "client": "rest",
        "users": clients,
        "tasks": executions * width,
        "executions": f"{executions}x{width}",
        "rest_poll_s": poll_interval_s,
        "gets/execution": f"{sum(len(u.get_ms) for u in users) / executions:.1f}",
    }
    if executor == "fleet":
        settings["agents"] = agents
    else:
        settings["workers"] = workers
    return RestClientResult(workload.BenchResult(executor, settings, [by_server, by_client]), costs)


def _client_clock(users: list[UserLog], by_server: workload.PhaseResult) -> workload.PhaseResult:
    """The same tasks timed by the users: first POST to the last "done" any user read;
    latency is each execution's round trip (POST sent → terminal status read)."""
    wall = max(u.last_done_at for u in users) - min(u.first_post_at for u in users)
    round_trips = sorted(ms for u in users for ms in u.round_trip_ms)
    return workload.PhaseResult(
        "rest (client clock)", by_server.tasks, wall, round_trips, by_server.failed
    )


def _under_load(name: str, users: list[UserLog], attribute: str) -> RequestCost:
    latencies = [ms for u in users for ms in getattr(u, attribute)]
    return RequestCost(name, len(latencies), latencies, None)
