"""The in-process (``default``) executor benchmark: one real `serve` subprocess.

Phases (each measured from the rows the server wrote):

* burst — executions submitted over REST by a few client threads while they run: the
  server parses and starts executions and runs their tasks on the same core;
* drain — the same number of executions queued in one transaction: the executor's own pace;
* paced — the same again, submitted at a steady rate below capacity (``--paced-rate`` tasks/s):
  Ready → started under load without a backlog (each execution's tasks still share the
  workers, so some wait for a sibling to finish);
* idle pickup — one single-task execution at a time: Ready → started on an idle server; its
  CPU per task is counted above the server's background, timed just before with nothing
  submitted.
"""

from __future__ import annotations

import time

from fleet.bench import workload
from fleet.bench.cpu import CpuMeter, CpuWindow
from fleet.bench.server import Api, BenchServer
from fleet.models import ApiKey, Tenant

BENCH_TENANT = "bench"
# Before the idle phase: the last phase's tail settles, then the server's background (ticks,
# probes) is timed with nothing submitted, for the idle pickups' CPU above it.
QUIET_SETTLE_S = 1.0
QUIET_WINDOW_S = 3.0


def bench_tenant_key() -> str:
    tenant, _ = Tenant.objects.get_or_create(name=BENCH_TENANT)
    return ApiKey.mint("write", tenant=tenant, label="fleetbench")[1]


def run_default_bench(
    database_url: str,
    tasks: int,
    width: int,
    idle_samples: int,
    workers: int,
    poll_s: float,
    paced_rate: float = 0.0,
) -> workload.BenchResult:
    key = bench_tenant_key()
    env = {"CLOACINA_WORKER_PROCESSES": str(workers), "CLOACINA_SCHEDULER_POLL_S": str(poll_s)}
    with BenchServer(database_url, "default", **env) as server:
        api = Api(server.url, key)
        try:
            api.upload(workload.noop_package(workload.WIDE_WORKFLOW, width))
            api.upload(workload.noop_package(workload.ONE_WORKFLOW, 1))
            # Warm-up: worker processes import the package once before anything is timed.
            warm = [api.start(workload.WIDE_WORKFLOW), api.start(workload.ONE_WORKFLOW)]
            workload.wait_finished(warm)
            executions = max(1, tasks // width)
            meter = CpuMeter(server.process.pid)
            before = meter.sample()
            burst_ids = workload.burst(lambda: Api(server.url, key), executions)
            workload.wait_finished(burst_ids)
            burst = workload.measure("burst", burst_ids)
            burst.cpu = meter.used(before, before := meter.sample())
            # The same tasks queued at once, no HTTP in the loop: the executor's own pace.
            drain_ids = workload.queue_executions(BENCH_TENANT, workload.WIDE_WORKFLOW, executions)
            workload.wait_finished(drain_ids)
            drain = workload.measure_drain("drain", drain_ids)
            drain.cpu = meter.used(before, meter.sample())
            phases = [burst, drain]
            if paced_rate:
                per_second = paced_rate / width  # executions per second for that many tasks
                paced_ids = workload.paced(api, executions, per_second)
                workload.wait_finished(paced_ids)
                phases.append(workload.measure(f"paced {paced_rate:g}/s", paced_ids))
            if idle_samples:
                # The background first (nothing submitted), then the lone tasks' CPU above it.
                time.sleep(QUIET_SETTLE_S)
                quiet = CpuWindow.open(meter)
                time.sleep(QUIET_WINDOW_S)
                quiet.close()
                window = CpuWindow.open(meter)
                idle_ids = workload.idle_pickups(api, idle_samples)
                window.close()
                phases.append(workload.measure("idle pickup", idle_ids))
                phases[-1].cpu = window.above(quiet)
        finally:
            api.close()
    settings = {
        "workers": workers,
        "tasks": executions * width,
        "executions": f"{executions}x{width}",
        "poll_s": poll_s,
    }
    return workload.BenchResult("default", settings, phases)
