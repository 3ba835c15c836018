"""The fleet benchmark: a real `serve --default-executor fleet` and N real `runagent` processes.

Phases, all measured from the rows the server wrote:

* burst (REST) — ``tasks`` no-op tasks submitted over the API as fast as it takes
  them (as the default benchmark does); throughput is tasks / (last
  ``finished_at`` − first ``ready_at``); latency is Ready → the agent confirmed it
  holds the packet (``delivery_outbox.received_at``), i.e. the moment the agent
  starts the task;
* drain (queued) — the same tasks made Ready in one transaction, so the API's
  pace is out of the picture: throughput from the first claim to the last finish;
* idle pickup — one single-task execution at a time on an idle fleet, same latency; its
  CPU per task (server, database, agents) is counted above the background, timed during the
  statistics' wait before it with nothing submitted (``background_cpu_ms/s``);
* failover — a task whose first run hangs: once an agent holds it, that agent
  is killed (SIGKILL to its process group) and the time to the task finishing
  on a survivor is measured (heartbeat interval × misses + a sweep + re-run).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from django.db import connection

from agents.models import Agent, AgentState
from artifacts.store.testing import build_archive, manifest_toml
from fleet.bench import db_work, workload
from fleet.bench.cpu import CpuMeter, CpuWindow, tree_cpu_seconds
from fleet.bench.default import BENCH_TENANT, bench_tenant_key
from fleet.bench.server import REPO, Api, BenchServer
from fleet.executors.fleet.state import ledger
from fleet.models import ApiKey, DeliveryOutbox, Tenant

AGENT_SLOTS = 16  # task slots per agent (runagent --max-concurrency)
HEARTBEAT_INTERVAL_S = (
    1.0  # short, for the failover phase; 0.5 s evicts healthy agents on a busy 2-core box
)
LIVENESS_MISSES = 3
AGENTS_READY_TIMEOUT_S = 60.0
# After the drain's last execution is done, the server still writes its tail (confirmations,
# the last result batch): the background's window starts this much later.
DRAIN_TAIL_S = 1.0
FAILOVER_WORKFLOW = "bench_failover"
HANG_ONCE_SOURCE = """
import time
from pathlib import Path


def hang_once(context):
    marker = Path(context["marker"])
    if not marker.exists():
        marker.write_text("first run")
        time.sleep(600)
    return None
"""


def _agent_key() -> str:
    tenant, _ = Tenant.objects.get_or_create(name=BENCH_TENANT)
    return ApiKey.mint("agent", tenant=tenant, label="fleetbench agents")[1]


class Agents:
    """``count`` runagent subprocesses, each in a session of its own (so one kill takes its children)."""

    def __init__(
        self,
        server_url: str,
        key: str,
        count: int,
        slots: int,
        home: Path,
        server_for: Callable[[int], str] | None = None,
    ) -> None:
        """``server_for(i)``: agent i's ``--server`` value instead of ``server_url`` (the
        replicas phase gives each agent its own order of several servers)."""
        self.processes: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        env = {
            **os.environ,
            "CLOACINA_HOME": str(home),
            "CLOACINA_LOG_LEVEL": "WARNING",
            "PYTHONUNBUFFERED": "1",
        }
        for i in range(count):
            name = f"bench-agent-{i + 1}"
            self.logs[name] = home / f"{name}.log"
            log = self.logs[name].open("wb")
            self.processes[name] = subprocess.Popen(
                [
                    sys.executable, str(REPO / "manage.py"), "runagent",
                    "--server", server_for(i) if server_for else server_url,
                    "--api-key", key, "--name", name, "--max-concurrency", str(slots),
                    "--cache-dir", str(home / f"cache-{name}"),
                ],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def wait_connected(self) -> None:
        deadline = time.monotonic() + AGENTS_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            connected = Agent.objects.filter(
                state=AgentState.LIVE, name__in=list(self.processes)
            ).exclude(connected_to="")
            if connected.count() == len(self.processes):
                return
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {process.returncode}: {self.log_tail(name)}"
                    )
            time.sleep(0.1)
        raise RuntimeError(f"agents not connected after {AGENTS_READY_TIMEOUT_S}s")

    def log_tail(self, name: str, lines: int = 5) -> str:
        """The last lines an agent wrote: why it exited, for the bench's error."""
        try:
            text = self.logs[name].read_text(errors="replace")
        except OSError:
            return "(no log)"
        return " | ".join(text.strip().splitlines()[-lines:]) or "(empty log)"

    def kill(self, name: str) -> None:
        try:
            os.killpg(self.processes[name].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for name, process in self.processes.items():
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                pass
            self.kill(name)


class FleetCpuMeter(CpuMeter):
    """The server's, the database's and the agents' CPU (each agent with its task children)."""

    def __init__(self, server_pid: int, agents: Agents) -> None:
        super().__init__(server_pid)
        self.agent_pids = [p.pid for p in agents.processes.values()]

    def sample(self) -> dict[str, float]:
        sample = super().sample()
        sample["agents"] = sum(tree_cpu_seconds(pid) for pid in self.agent_pids)
        return sample


def idle_cpu_settings(phases: list[workload.PhaseResult], quiet: CpuWindow) -> dict[str, str]:
    """The agents' CPU per idle pickup (the table has the server's and the database's), and
    the background it is counted above, for the settings line."""
    rates = quiet.rates()
    background = ",".join(f"{name}:{rate * 1000.0:.0f}" for name, rate in rates.items())
    settings = {"background_cpu_ms/s": background}
    for phase in phases:
        if phase.name == "idle pickup" and phase.tasks:
            per_task = phase.cpu.get("agents", 0.0) * 1000.0 / phase.tasks
            settings["agents_cpu_ms/task(idle)"] = f"{per_task:.2f}"
    return settings


def measure_fleet(name: str, execution_ids: list[str]) -> workload.PhaseResult:
    """Throughput as the default bench; latency Ready → the agent holds the packet."""
    phase = workload.measure(name, execution_ids)
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            SELECT EXTRACT(EPOCH FROM o.received_at - t.ready_at) * 1000.0
            FROM fleet_taskexecution t
            JOIN {ledger.OUTBOX} o ON o.task_execution_id = t.id AND o.assignment = t.assignment
            WHERE t.workflow_execution_id = ANY(%s::uuid[]) AND o.received_at IS NOT NULL
            """,
            [execution_ids],
        )
        phase.latencies_ms = sorted(float(row[0]) for row in cursor.fetchall())
    return phase


def measure_drain(name: str, execution_ids: list[str]) -> workload.PhaseResult:
    """Like :func:`measure_fleet`, but the clock starts at the first claim (pre-queued work)."""
    phase = measure_fleet(name, execution_ids)
    phase.wall_s = workload.drain_wall_s(execution_ids)
    return phase


def failover(api: Api, agents: Agents, home: Path) -> workload.PhaseResult:
    """Kill the agent holding a hanging task; time until a survivor finished it."""
    tasks = [{"id": "hang", "function": "bench.steps:hang_once", "timeout_s": 900}]
    api.upload(
        build_archive(
            {
                "cloacina.toml": manifest_toml(
                    tasks, name="bench-failover", workflow=FAILOVER_WORKFLOW
                ),
                "workflow/bench/__init__.py": "",
                "workflow/bench/steps.py": HANG_ONCE_SOURCE,
            }
        )
    )
    execution_id = api.start(FAILOVER_WORKFLOW, {"marker": str(home / "markers" / "failover")})
    holder = None
    deadline = time.monotonic() + 60
    while holder is None and time.monotonic() < deadline:
        name = (
            DeliveryOutbox.objects.filter(
                task_execution__workflow_execution_id=execution_id, received_at__isnull=False
            )
            .values_list("agent__name", flat=True)
            .first()
        )
        holder = name if name and (home / "markers" / "failover").exists() else None
        time.sleep(0.02)
    if holder is None:
        raise RuntimeError("the failover task never reached an agent")
    killed_at = time.time()
    agents.kill(holder)
    workload.wait_finished([execution_id], poll_s=0.01)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXTRACT(EPOCH FROM finished_at), status FROM fleet_taskexecution "
            "WHERE workflow_execution_id = %s",
            [execution_id],
        )
        finished_at, status = cursor.fetchone()
    seconds = float(finished_at) - killed_at
    return workload.PhaseResult(
        "failover (kill -9)", 1, seconds, [seconds * 1000.0], int(status != "Completed")
    )


def server_env(poll_s: float) -> dict[str, str]:
    """The fleet servers' settings for a bench run: the scheduler tick, the short beats."""
    return {
        "CLOACINA_SCHEDULER_POLL_S": str(poll_s),
        "CLOACINA_AGENT_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_INTERVAL_S),
        "CLOACINA_AGENT_LIVENESS_MISSES": str(LIVENESS_MISSES),
    }


def run_fleet_bench(
    database_url: str,
    agents: int,
    tasks: int,
    width: int = 10,
    idle_samples: int = 100,
    poll_s: float = 1.0,
    slots: int = AGENT_SLOTS,
) -> workload.BenchResult:
    """Burst, idle pickup and failover through the fleet (see the module docstring)."""
    key = bench_tenant_key()
    akey = _agent_key()
    env = server_env(poll_s)
    home = Path(tempfile.mkdtemp(prefix="cloacina-fleetbench-agents-"))
    # Run as root, the agents' task children run as the unprivileged task user: it must
    # pass through to the caches and write the failover marker.
    os.chmod(home, 0o711)
    (home / "markers").mkdir(mode=0o777)
    os.chmod(home / "markers", 0o777)
    with BenchServer(database_url, "fleet", **env) as server:
        api = Api(server.url, key)
        fleet = Agents(server.url, akey, agents, slots, home)
        try:
            fleet.wait_connected()
            api.upload(workload.noop_package(workload.WIDE_WORKFLOW, width))
            api.upload(workload.noop_package(workload.ONE_WORKFLOW, 1))
            # Warm-up: every agent fetches and unpacks the packages once before anything is timed.
            warm = [api.start(workload.WIDE_WORKFLOW) for _ in range(agents * 2)]
            warm.append(api.start(workload.ONE_WORKFLOW))
            workload.wait_finished(warm)
            executions = max(1, tasks // width)
            meter = FleetCpuMeter(server.process.pid, fleet)
            before = meter.sample()
            wrote_before = db_work.snapshot()
            burst_ids = workload.burst(lambda: Api(server.url, key), executions)
            workload.wait_finished(burst_ids)
            phases = [measure_fleet("burst (REST)", burst_ids)]
            phases[-1].cpu = meter.used(before, before := meter.sample())
            burst_wrote = db_work.per_task(
                wrote_before, wrote_before := db_work.snapshot(), phases[-1].tasks
            )
            before = meter.sample()  # the snapshot's wait is not the drain's
            drain_ids = workload.queue_executions(BENCH_TENANT, workload.WIDE_WORKFLOW, executions)
            workload.wait_finished(drain_ids)
            phases.append(measure_drain("drain (queued)", drain_ids))
            phases[-1].cpu = meter.used(before, meter.sample())
            # The statistics' wait doubles as the background's window: nothing is submitted
            # (its first second left to the drain's tail: confirmations, the last results).
            time.sleep(DRAIN_TAIL_S)
            quiet = CpuWindow.open(meter)
            drain_stats = db_work.snapshot(settle_s=db_work.STATS_DELAY_S - DRAIN_TAIL_S)
            quiet.close()
            drain_wrote = db_work.per_task(wrote_before, drain_stats, phases[-1].tasks)
            agent_cpu_ms = phases[-1].cpu["agents"] * 1000.0 / max(phases[-1].tasks, 1)
            if idle_samples:
                window = CpuWindow.open(meter)
                idle_ids = workload.idle_pickups(api, idle_samples)
                window.close()
                phases.append(measure_fleet("idle pickup", idle_ids))
                phases[-1].cpu = window.above(quiet)
            if agents > 1:
                phases.append(failover(api, fleet, home))
        finally:
            api.close()
            fleet.stop()
    shutil.rmtree(home, ignore_errors=True)  # the agents' caches; kept if the run failed
    settings = {
        "agents": agents,
        "slots": slots,
        "tasks": executions * width,
        "executions": f"{executions}x{width}",
        "poll_s": poll_s,
        "heartbeat": f"{HEARTBEAT_INTERVAL_S:g}sx{LIVENESS_MISSES}",
        "agents_cpu_ms/task(drain)": f"{agent_cpu_ms:.2f}",
        **idle_cpu_settings(phases, quiet),
        **{f"{k}(burst)": v for k, v in burst_wrote.items()},
        **{f"{k}(drain)": v for k, v in drain_wrote.items()},
    }
    return workload.BenchResult("fleet", settings, phases)
