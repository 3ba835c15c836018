"""The scale phase: ``fleetbench --executor fleet --simulated-agents N --tenants T [--tasks K]``.

A real ``serve --default-executor fleet`` and N simulated agents (fleet/bench/swarm.py:
the runtime's own agent code, thousands in one process, real WebSockets) spread over
T tenants, each tenant with its own keys.  Measured, in this order:

* connect — every agent registered over REST and holding its delivery socket, and
  registrations per second (first start → last ``registered_at``);
* idle — the server's CPU (% of one core) and resident memory per agent over a quiet
  window of at least ``windows`` liveness windows (heartbeat interval × misses), read
  from /proc of the ``serve`` process; the server with no agents is the baseline;
* evictions — agents declared dead from the first registration to the end of dispatch
  (healthy agents: must be zero);
* dispatch — K no-op tasks over the T tenants, made Ready in one transaction; tasks/s
  from the first claim to the last finish, and whether every task was completed
  exactly once (one outcome per task, applied; one run in the swarm per task);
* deadlocks — ``pg_stat_database.deadlocks`` of the bench database, before the server
  starts and after it stopped (its backends flush their counters as they exit).
"""

from __future__ import annotations

import contextlib
import logging
import math
import resource
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import psutil
from django.db import transaction
from django.db.models import Count, Q

from agents.models import Agent, AgentState
from fleet.bench import workload
from fleet.bench.database import deadlocks
from fleet.bench.server import Api, BenchServer
from fleet.bench.swarm import FILES_PER_AGENT, Swarm, SwarmKey
from fleet.bench.workload import PhaseResult
from fleet.engine.scheduler import start_execution
from fleet.models import ApiKey, Eviction, TaskExecution, Tenant

TENANT_PREFIX = "swarm"
AGENTS_PER_KEY = 50  # under the server's default registration rate of 60 per key per minute
SLOTS = 16  # task slots per simulated agent
CONNECT_TIMEOUT_S = 600.0
CONNECT_FLOOR_PER_S = 2.5  # agents connected per second the connect timeout allows for
BASELINE_S = 5.0  # the idle server, no agents yet
POLL_S = 0.2
KB = 1024


@dataclass
class ScaleSettings:
    agents: int
    tenants: int
    tasks: int
    width: int = 10
    heartbeat_s: float = 15.0
    misses: int = 3
    windows: int = 3
    agents_per_key: int = AGENTS_PER_KEY
    slots: int = SLOTS
    poll_s: float = 1.0
    idle: bool = True  # watch the quiet windows (the tenant-ratio phases skip them)
    drain: bool = True  # drain the agents at the end (False: cancel them; tenant-ratio)

    @property
    def liveness_window_s(self) -> float:
        return self.heartbeat_s * self.misses


# fleetbench's options for this phase: (flag, type, default, help).
SWARM_ARGUMENTS: tuple[tuple[str, type, object, str], ...] = (
    ("--simulated-agents", int, 0,
     "instead (fleet): N simulated agents in this process; connect, idle, dispatch"),
    ("--tenants", int, 1, "tenants the simulated agents spread over"),
    ("--heartbeat-interval", float, 15.0,
     "seconds between beats (simulated agents; the server's setting)"),
    ("--liveness-misses", int, 3, "beats missed before an eviction"),
    ("--liveness-windows", int, 3, "liveness windows the idle phase watches for evictions"),
    ("--agents-per-key", int, AGENTS_PER_KEY, "simulated agents registering with one agent key"),
)  # fmt: skip


def scale_settings(options: dict) -> ScaleSettings | None:
    """The phase's settings from fleetbench's options; None without ``--simulated-agents``.
    Raises ValueError naming the bad option (checked before any database is touched)."""
    agents = options["simulated_agents"]
    if agents < 0:
        raise ValueError(f"--simulated-agents must be >= 0, got {agents}")
    for name in ("tenants", "liveness_misses", "liveness_windows", "agents_per_key"):
        if options[name] < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {options[name]}")
    if options["heartbeat_interval"] <= 0:
        raise ValueError(f"--heartbeat-interval must be > 0, got {options['heartbeat_interval']:g}")
    if not agents:
        return None
    if options["executor"] != "fleet":
        raise ValueError("--simulated-agents needs --executor fleet")
    if options["tenants"] > agents:
        raise ValueError("--tenants must not exceed --simulated-agents")
    return ScaleSettings(
        agents=agents,
        tenants=options["tenants"],
        tasks=options["tasks"],
        width=options["width"],
        heartbeat_s=options["heartbeat_interval"],
        misses=options["liveness_misses"],
        windows=options["liveness_windows"],
        agents_per_key=options["agents_per_key"],
        poll_s=options["poll"],
    )


@dataclass
class ScaleResult:
    settings: ScaleSettings
    figures: list[tuple[str, str]] = field(default_factory=list)
    log: str = ""  # where the server's log was kept
    dispatch: PhaseResult | None = None  # the measured dispatch (not the warm-up)
    server_cpu_s: float = 0.0  # the server's CPU over the measured dispatch
    deadlocks: int = 0  # pg_stat_database.deadlocks, server start → server stopped

    def add(self, name: str, value: str) -> None:
        self.figures.append((name, value))

    def table(self) -> str:
        s = self.settings
        head = (
            f"fleetbench: executor=fleet simulated-agents={s.agents} tenants={s.tenants} "
            f"tasks={s.tasks} heartbeat={s.heartbeat_s:g}sx{s.misses} slots={s.slots}"
        )
        width = max(len(name) for name, _ in self.figures)
        lines = [f"{name.ljust(width)}  {value}" for name, value in self.figures]
        rule = "-" * max(len(head), *(len(line) for line in lines))
        return "\n".join([head, rule, *lines, rule])


def raise_open_files_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (children inherit it:
    the server under test holds a socket per agent, the swarm another); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def spread(total: int, parts: int) -> list[int]:
    """``total`` split over ``parts`` as evenly as integers go (the first ones take the rest)."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def _tenants(settings: ScaleSettings) -> tuple[list[Tenant], list[str], list[SwarmKey]]:
    """The bench's tenants, a write key each, and enough agent keys to keep every key under
    ``agents_per_key`` registrations."""
    tenants, write_keys, swarm_keys = [], [], []
    for index, count in enumerate(spread(settings.agents, settings.tenants)):
        tenant, _ = Tenant.objects.get_or_create(name=f"{TENANT_PREFIX}-{index + 1:03d}")
        tenants.append(tenant)
        write_keys.append(ApiKey.mint("write", tenant=tenant, label="fleetbench swarm")[1])
        keys = max(1, math.ceil(count / settings.agents_per_key))
        for share in spread(count, keys):
            if share:
                token = ApiKey.mint("agent", tenant=tenant, label="fleetbench swarm")[1]
                swarm_keys.append(SwarmKey(tenant.name, token, share))
    return tenants, write_keys, swarm_keys


class ServerProbe:
    """CPU seconds and resident memory of the ``serve`` process, from /proc (psutil)."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)

    def cpu_s(self) -> float:
        times = self.process.cpu_times()
        return times.user + times.system

    def rss(self) -> int:
        return self.process.memory_info().rss

    def idle(self, seconds: float) -> tuple[float, int]:
        """CPU % of one core over ``seconds`` of waiting, and the RSS at their end."""
        cpu, started = self.cpu_s(), time.monotonic()
        time.sleep(seconds)
        return 100.0 * (self.cpu_s() - cpu) / (time.monotonic() - started), self.rss()


def own_cpu_s() -> float:
    """CPU seconds of this process (the swarm's thread and the bench's polling)."""
    times = psutil.Process().cpu_times()
    return times.user + times.system


def live_connected(tenants: list[Tenant]) -> int:
    return (
        Agent.objects.filter(tenant__in=tenants, state=AgentState.LIVE)
        .exclude(connected_to="")
        .count()
    )


def connect_timeout_s(agents: int) -> float:
    """How long the connect phase may take: at least CONNECT_TIMEOUT_S, and room for a slow
    2.5 agents a second (a loaded machine connected 5,000 agents at 3-6 a second)."""
    return max(CONNECT_TIMEOUT_S, agents / CONNECT_FLOOR_PER_S)


def wait_connected(swarm: Swarm, tenants: list[Tenant]) -> float:
    """Seconds until every agent is live with its socket open (by the server's rows)."""
    timeout_s = connect_timeout_s(swarm.size)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        swarm.check()
        if live_connected(tenants) == swarm.size:
            return time.time() - swarm.started_at
        time.sleep(POLL_S)
    counts = swarm.counts()
    raise RuntimeError(
        f"{live_connected(tenants)}/{swarm.size} agents connected after "
        f"{timeout_s:.0f}s (swarm: {counts})"
    )


def registration_rate(swarm: Swarm, tenants: list[Tenant]) -> float:
    """Registrations per second: the swarm's start → the last ``registered_at``."""
    rows = Agent.objects.filter(tenant__in=tenants)
    last = rows.order_by("-registered_at").values_list("registered_at", flat=True).first()
    elapsed = last.timestamp() - swarm.started_at if last else 0.0
    return rows.count() / elapsed if elapsed > 0 else float("nan")


def queue_spread(tenants: list[Tenant], executions: int) -> list[str]:
    """``executions`` executions round-robin over ``tenants``, all Ready in one transaction."""
    with transaction.atomic():
        return [
            str(start_execution(tenants[i % len(tenants)], workload.WIDE_WORKFLOW, {}).id)
            for i in range(executions)
        ]


def exactly_once(execution_ids: list[str]) -> int:
    """Tasks Completed with exactly one outcome recorded, and that one applied."""
    return (
        TaskExecution.objects.filter(workflow_execution_id__in=execution_ids, status="Completed")
        .annotate(
            outcomes_n=Count("outcomes"),
            applied_n=Count("outcomes", filter=Q(outcomes__applied=True)),
        )
        .filter(outcomes_n=1, applied_n=1)
        .count()
    )


def run_scale_bench(database_url: str, settings: ScaleSettings) -> ScaleResult:
    """Connect, idle, evictions, dispatch and deadlocks at scale (see the module docstring)."""
    result = ScaleResult(settings)
    # Thousands of agents would each log their start, registration and stop.
    logging.getLogger("cloacina.agent").setLevel(logging.WARNING)
    # ... and each result the server was slow to acknowledge (it is then posted over REST).
    logging.getLogger("agents.runtime").setLevel(logging.WARNING)
    nofile = raise_open_files_limit()
    if nofile < FILES_PER_AGENT * settings.agents + 1024:
        raise RuntimeError(
            f"the open-files limit ({nofile}) is too low for {settings.agents} agents: the "
            f"swarm (and the server) hold a socket and up to {FILES_PER_AGENT - 1} REST "
            f"connections per agent; raise `ulimit -Hn`"
        )
    tenants, write_keys, swarm_keys = _tenants(settings)
    per_tenant = max(spread(settings.agents, settings.tenants))
    env = {
        "CLOACINA_SCHEDULER_POLL_S": str(settings.poll_s),
        "CLOACINA_AGENT_HEARTBEAT_INTERVAL_S": str(settings.heartbeat_s),
        "CLOACINA_AGENT_LIVENESS_MISSES": str(settings.misses),
        "CLOACINA_MAX_REGISTERED_AGENTS": str(per_tenant),
    }
    deadlocks_before = deadlocks()
    server = BenchServer(database_url, "fleet", **env)
    try:
        server.start()
        _upload(server.url, write_keys, settings.width)
        probe = ServerProbe(server.process.pid)
        base_cpu_pct, base_rss = probe.idle(BASELINE_S)
        swarm = Swarm(server.url, swarm_keys, slots=settings.slots)
        try:
            _connect(result, swarm, tenants, probe)
            if settings.idle:
                _idle(result, probe, swarm, base_cpu_pct, base_rss)
            idle_evictions = evictions(tenants, swarm.started_at)
            _dispatch(result, swarm, tenants, settings, probe)
            total = evictions(tenants, swarm.started_at)
            result.add("evictions", f"{total} (connect + idle: {idle_evictions})")
        finally:
            swarm.stop(drain=settings.drain)
        counts = swarm.counts()
        drained = f"{counts.exited - counts.failed}/{counts.started}"
        result.add("agents drained", drained if settings.drain else "no (cancelled)")
    finally:
        server.stop()
        result.log = _keep_log(server)
    result.deadlocks = deadlocks() - deadlocks_before
    result.add("pg deadlocks", str(result.deadlocks))
    result.add("server log", result.log)
    return result


def evictions(tenants: list[Tenant], since_epoch_s: float) -> int:
    since = datetime.fromtimestamp(since_epoch_s, tz=UTC)
    return Eviction.objects.filter(tenant__in=tenants, evicted_at__gte=since).count()


def _upload(url: str, write_keys: list[str], width: int) -> None:
    for key in write_keys:
        api = Api(url, key)
        try:
            api.upload(workload.noop_package(workload.WIDE_WORKFLOW, width))
        finally:
            api.close()


def _keep_log(server: BenchServer) -> str:
    """The server's log, copied out of its home (which a clean stop removes): at scale it is
    where evictions, deadlocks and refused registrations are explained."""
    kept = Path(tempfile.gettempdir()) / f"fleetbench-scale-{int(time.time())}-serve.log"
    with contextlib.suppress(OSError):
        shutil.copyfile(server.log_path, kept)
        shutil.rmtree(server.home, ignore_errors=True)
        return str(kept)
    return str(server.log_path)


def _connect(result: ScaleResult, swarm: Swarm, tenants: list[Tenant], probe: ServerProbe) -> None:
    cpu_before, own_before = probe.cpu_s(), own_cpu_s()
    swarm.start()
    connect_s = wait_connected(swarm, tenants)
    cpu_s = probe.cpu_s() - cpu_before
    swarm_cpu_s = own_cpu_s() - own_before
    result.add("agents connected", f"{live_connected(tenants)}/{swarm.size}")
    result.add("connect wall s", f"{connect_s:.1f}")
    result.add("registrations/s", f"{registration_rate(swarm, tenants):.0f}")
    # Registration, socket open and hello; CPU time, which the machine's load does not inflate.
    result.add("server CPU ms/agent connect", f"{1000.0 * cpu_s / swarm.size:.2f}")
    # The swarm shares the machine's cores with the server: what it took while connecting.
    result.add(
        "swarm CPU ms/agent connect",
        f"{1000.0 * swarm_cpu_s / swarm.size:.2f} ({100.0 * swarm_cpu_s / connect_s:.0f} % of a core)",
    )


def _idle(
    result: ScaleResult, probe: ServerProbe, swarm: Swarm, base_cpu_pct: float, base_rss: int
) -> None:
    window_s = result.settings.windows * result.settings.liveness_window_s
    own_before = own_cpu_s()
    cpu_pct, rss = probe.idle(window_s)
    swarm_pct = 100.0 * (own_cpu_s() - own_before) / window_s
    result.add("quiet window s", f"{window_s:.1f} ({result.settings.windows} liveness windows)")
    result.add("idle server CPU %", f"{cpu_pct:.1f} (no agents: {base_cpu_pct:.1f})")
    result.add("idle swarm CPU %", f"{swarm_pct:.1f}")
    beats_per_s = swarm.size / result.settings.heartbeat_s
    beat_ms = 10.0 * (cpu_pct - base_cpu_pct) / beats_per_s  # % of a core → ms per second
    result.add("server CPU ms/beat", f"{beat_ms:.2f}")
    result.add("server RSS MB", f"{rss / KB / KB:.0f} (no agents: {base_rss / KB / KB:.0f})")
    result.add("server KB/agent", f"{(rss - base_rss) / KB / swarm.size:.1f}")


def _dispatch(
    result: ScaleResult,
    swarm: Swarm,
    tenants: list[Tenant],
    settings: ScaleSettings,
    probe: ServerProbe,
) -> None:
    warm = queue_spread(tenants, len(tenants))  # one execution per tenant: caches filled
    workload.wait_finished(warm)
    runs_before = swarm.counts().runs
    executions = max(1, math.ceil(settings.tasks / settings.width))
    cpu_before = probe.cpu_s()
    ids = queue_spread(tenants, executions)
    workload.wait_finished(ids)
    cpu_s = probe.cpu_s() - cpu_before
    phase = workload.measure_drain("dispatch", ids)
    result.dispatch, result.server_cpu_s = phase, cpu_s
    result.add("dispatch tasks", f"{phase.tasks} (failed {phase.failed})")
    result.add("dispatch tasks/s", f"{phase.throughput:.0f}")
    result.add("server CPU ms/task", f"{1000.0 * cpu_s / max(phase.tasks, 1):.2f}")
    result.add("completed exactly once", f"{exactly_once(ids)}/{phase.tasks}")
    result.add("simulated runs", str(swarm.counts().runs - runs_before))
