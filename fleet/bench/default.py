"""The in-process (``default``) executor benchmark: one real `serve` subprocess."""

from __future__ import annotations

from fleet.bench import workload
from fleet.bench.cpu import CpuMeter
from fleet.bench.server import Api, BenchServer
from fleet.models import ApiKey, Tenant

BENCH_TENANT = "bench"


def bench_tenant_key() -> str:
    tenant, _ = Tenant.objects.get_or_create(name=BENCH_TENANT)
    return ApiKey.mint("write", tenant=tenant, label="fleetbench")[1]


def run_default_bench(
    database_url: str, tasks: int, width: int, idle_samples: int, workers: int, poll_s: float
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
            burst.cpu = meter.used(before, meter.sample())
            phases = [burst]
            if idle_samples:
                idle_ids = workload.idle_pickups(api, idle_samples)
                phases.append(workload.measure("idle pickup", idle_ids))
        finally:
            api.close()
    settings = {
        "workers": workers,
        "tasks": executions * width,
        "executions": f"{executions}x{width}",
        "poll_s": poll_s,
    }
    return workload.BenchResult("default", settings, phases)
