"""The replicas phase of ``fleetbench`` (``--replicas N``): N `serve --default-executor
fleet` processes on the bench database, the agents spread over them (agent i starts on
replica i mod N and lists the others as fallbacks, as docs/scaling.md recommends), and the
work submitted round-robin through every replica's API.

Phases, measured from the rows as the fleet benchmark measures them:

* burst (REST, N replicas) — the no-op executions started through all N APIs at once;
* drain (queued, N replicas) — the same made Ready in one transaction: every replica's
  dispatch loop competes for them;
* idle connections — PostgreSQL backends on the bench database while the N replicas
  and their agents idle, total and per replica (the figure docs/scaling.md's formula
  predicts);
* idle database load — commits and WAL bytes per second while only the agents' beats
  (one per agent per heartbeat interval) and the replicas' own ticks run, then again with
  the agents stopped: the difference per beat is what a heartbeat costs the database.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from django.db import connection

from fleet.bench import workload
from fleet.bench.cpu import CpuMeter, tree_cpu_seconds
from fleet.bench.default import BENCH_TENANT, bench_tenant_key
from fleet.bench.fleet import (
    AGENT_SLOTS,
    HEARTBEAT_INTERVAL_S,
    Agents,
    measure_drain,
    measure_fleet,
    server_env,
)
from fleet.bench.server import Api, BenchServer
from fleet.models import ApiKey, Tenant

SETTLE_S = 2.0  # idle time before counting connections (pools shrink back, beats settle)
IDLE_MEASURE_S = 10.0  # how long the idle database load is measured


def agent_key() -> str:
    """A fresh agent key of the bench tenant for the replicas' agents."""
    tenant, _ = Tenant.objects.get_or_create(name=BENCH_TENANT)
    return ApiKey.mint("agent", tenant=tenant, label="fleetbench replica agents")[1]


def server_order(urls: list[str], i: int) -> str:
    """Agent ``i``'s --server value: replica i mod N first, then the others in turn."""
    start = i % len(urls)
    return ",".join(urls[start:] + urls[:start])


class RoundRobinApi:
    """Each call makes an :class:`Api` for the next replica (one per submitting thread)."""

    def __init__(self, urls: list[str], key: str) -> None:
        self._urls = itertools.cycle(urls)
        self._lock = threading.Lock()
        self._key = key

    def __call__(self) -> Api:
        with self._lock:
            url = next(self._urls)
        return Api(url, self._key)


def backends_on(database: str) -> int:
    """Client backends connected to ``database`` now, this process's own excluded."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
            "AND backend_type = 'client backend' AND pid <> pg_backend_pid()",
            [database],
        )
        return int(cursor.fetchone()[0])


def idle_database_load(seconds: float) -> tuple[float, float]:
    """(commits/s, WAL bytes/s) of the whole PostgreSQL server over ``seconds`` of idling."""

    def snapshot() -> tuple[int, int]:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT (SELECT sum(xact_commit) FROM pg_stat_database), "
                "pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')"
            )
            commits, wal = cursor.fetchone()
        return int(commits), int(wal)

    commits_before, wal_before = snapshot()
    time.sleep(seconds)
    commits_after, wal_after = snapshot()
    # pg_stat_database is updated by backends about once a second: the rate is approximate.
    return (commits_after - commits_before) / seconds, (wal_after - wal_before) / seconds


def run_replicas_bench(
    database_url: str,
    replicas: int,
    agents: int,
    tasks: int,
    width: int = 10,
    poll_s: float = 1.0,
    slots: int = AGENT_SLOTS,
) -> workload.BenchResult:
    """Burst and drain through ``replicas`` servers sharing ``agents`` (module docstring)."""
    executions = max(1, tasks // width)
    key, akey = bench_tenant_key(), agent_key()
    home = Path(tempfile.mkdtemp(prefix="cloacina-fleetbench-replicas-"))
    os.chmod(home, 0o711)  # the agents' task user passes through to the caches
    with ExitStack() as stack:
        servers = [stack.enter_context(BenchServer(database_url, "fleet", **server_env(poll_s))) for _ in range(replicas)]  # fmt: skip
        urls = [server.url for server in servers]
        api = Api(urls[0], key)
        stack.callback(api.close)
        fleet = Agents(urls[0], akey, agents, slots, home, lambda i: server_order(urls, i))
        stack.callback(fleet.stop)
        fleet.wait_connected()
        api.upload(workload.noop_package(workload.WIDE_WORKFLOW, width))
        warm = []
        for url in urls:
            through = Api(url, key)
            warm += [through.start(workload.WIDE_WORKFLOW) for _ in range(agents)]
            through.close()
        workload.wait_finished(warm)  # every agent has the package unpacked
        time.sleep(SETTLE_S)
        idle_backends = backends_on(connection.settings_dict["NAME"])
        commits_per_s, wal_per_s = idle_database_load(IDLE_MEASURE_S)
        meter = ServersCpuMeter([server.process.pid for server in servers])
        before = meter.sample()
        burst_ids = workload.burst(RoundRobinApi(urls, key), executions)
        workload.wait_finished(burst_ids)
        phases = [measure_fleet(f"burst (REST, {replicas} replicas)", burst_ids)]
        phases[-1].cpu = meter.used(before, before := meter.sample())
        drain_ids = workload.queue_executions(BENCH_TENANT, workload.WIDE_WORKFLOW, executions)
        workload.wait_finished(drain_ids)
        phases.append(measure_drain(f"drain (queued, {replicas} replicas)", drain_ids))
        phases[-1].cpu = meter.used(before, meter.sample())
        # The same idle load without the agents: the difference is what their beats cost.
        fleet.stop()
        time.sleep(SETTLE_S)
        bare_commits, bare_wal = idle_database_load(IDLE_MEASURE_S)
    shutil.rmtree(home, ignore_errors=True)
    beats_per_s = agents / HEARTBEAT_INTERVAL_S
    settings = {
        "replicas": replicas,
        "agents": agents,
        "slots": slots,
        "tasks": executions * width,
        "executions": f"{executions}x{width}",
        "idle_db_connections": idle_backends,
        "per_replica": f"{idle_backends / replicas:.1f}",
        "heartbeat": f"{HEARTBEAT_INTERVAL_S:g}s",
        "idle_commits/s": f"{commits_per_s:.0f}",
        "idle_wal_KB/s": f"{wal_per_s / 1024:.1f}",
        "without_agents": f"{bare_commits:.0f}/s,{bare_wal / 1024:.1f}KB/s",
        "wal_bytes/beat": f"{(wal_per_s - bare_wal) / beats_per_s:.0f}",
    }
    return workload.BenchResult("fleet", settings, phases)


class ServersCpuMeter(CpuMeter):
    """The CPU of every replica (summed as "server") and of the database."""

    def __init__(self, server_pids: list[int]) -> None:
        super().__init__(server_pids[0])
        self.others = server_pids[1:]

    def sample(self) -> dict[str, float]:
        sample = super().sample()
        sample["server"] += sum(tree_cpu_seconds(pid) for pid in self.others)
        return sample
