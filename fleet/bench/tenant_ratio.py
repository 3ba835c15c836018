"""The multi-tenant penalty at scale: ``fleetbench --executor fleet --simulated-agents N
--tenants T --tenant-ratio R``.

The scale phase (fleet/bench/scale.py: a real ``serve``, N simulated agents over real
WebSockets, K no-op tasks made Ready at once) run with every agent in ONE tenant and then
with the same agents and the same tasks spread over T tenants, on an emptied database each
time, without the idle windows.  ``R`` rounds alternate the order (1, T, then T, 1, …), so a
machine that gets busier or quieter during the run does not favour one side; the phases of
each kind are summed.  Printed per kind: tasks/s of the dispatch (first claim → last
finish), the server's CPU per task, the PostgreSQL deadlocks of its phases
(``pg_stat_database.deadlocks``), evictions; then the T-tenant throughput as a share of the
single-tenant one — issue 16's target is ≥ 90 % with zero deadlocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from django.core.management import call_command

from fleet.bench.scale import ScaleResult, ScaleSettings, run_scale_bench

TARGET_SHARE = 0.90  # issue 16: T tenants dispatch at >= 90 % of one tenant


@dataclass
class RatioPhase:
    """One kind of phase (a tenant count), its runs summed."""

    tenants: int
    runs: int = 0
    tasks: int = 0
    failed: int = 0
    wall_s: float = 0.0
    server_cpu_s: float = 0.0
    deadlocks: int = 0

    @property
    def throughput(self) -> float:
        return self.tasks / self.wall_s if self.wall_s > 0 else 0.0

    def add(self, run: ScaleResult) -> None:
        if run.dispatch is None:
            raise RuntimeError(f"the {self.tenants}-tenant phase measured no dispatch")
        self.runs += 1
        self.tasks += run.dispatch.tasks
        self.failed += run.dispatch.failed
        self.wall_s += run.dispatch.wall_s
        self.server_cpu_s += run.server_cpu_s
        self.deadlocks += run.deadlocks


@dataclass
class TenantRatioResult:
    settings: ScaleSettings
    one: RatioPhase
    many: RatioPhase
    runs: list[tuple[int, float, int]]  # (tenants, tasks/s, deadlocks) of each run, in order
    logs: list[str]

    @property
    def share(self) -> float:
        return self.many.throughput / self.one.throughput if self.one.throughput else 0.0

    def table(self) -> str:
        s = self.settings
        lines = [
            f"fleetbench: tenant ratio, simulated-agents={s.agents} tasks={s.tasks} "
            f"width={s.width} slots={s.slots}, 1 tenant vs {self.many.tenants}",
            f"{'tenants':>8} {'runs':>5} {'tasks':>7} {'failed':>7} {'wall s':>8} "
            f"{'tasks/s':>8} {'CPU ms/task':>12} {'deadlocks':>10}",
        ]
        for p in (self.one, self.many):
            cpu_ms = 1000.0 * p.server_cpu_s / max(p.tasks, 1)
            lines.append(
                f"{p.tenants:>8} {p.runs:>5} {p.tasks:>7} {p.failed:>7} {p.wall_s:>8.2f} "
                f"{p.throughput:>8.1f} {cpu_ms:>12.2f} {p.deadlocks:>10}"
            )
        order = ", ".join(f"{t}: {rate:.0f}/s ({d} deadlocks)" for t, rate, d in self.runs)
        lines.append(f"runs in order: {order}")
        verdict = "met" if self.share >= TARGET_SHARE and not self.many.deadlocks else "NOT met"
        lines.append(
            f"{self.many.tenants} tenants vs 1: {100 * self.share:.0f} % of the single-tenant "
            f"throughput, {self.one.deadlocks + self.many.deadlocks} deadlocks "
            f"(target >= {100 * TARGET_SHARE:.0f} % and 0: {verdict})"
        )
        lines += [f"server log: {log}" for log in self.logs]
        return "\n".join(lines)


def phase_order(tenants: int, rounds: int) -> list[int]:
    """1, T for the first round, T, 1 for the second, and so on."""
    order: list[int] = []
    for index in range(rounds):
        order += [1, tenants] if index % 2 == 0 else [tenants, 1]
    return order


def run_tenant_ratio_bench(
    database_url: str,
    settings: ScaleSettings,
    rounds: int,
    progress: Callable[[str], None] = print,
) -> TenantRatioResult:
    """The scale phase's dispatch with one tenant and with ``settings.tenants`` (see the
    module docstring); ``progress`` gets a line as each run ends."""
    one, many = RatioPhase(1), RatioPhase(settings.tenants)
    runs: list[tuple[int, float, int]] = []
    logs: list[str] = []
    for count in phase_order(settings.tenants, rounds):
        call_command("flush", interactive=False, verbosity=0)
        # No quiet windows; the agents are cancelled, not drained: a thousand drains would
        # still be retrying in this process during the next phase.
        phase = replace(settings, tenants=count, idle=False, drain=False)
        run = run_scale_bench(database_url, phase)
        (one if count == 1 else many).add(run)
        assert run.dispatch is not None  # checked by add()
        runs.append((count, run.dispatch.throughput, run.deadlocks))
        logs.append(run.log)
        progress(
            f"{count} tenant(s): {run.dispatch.throughput:.0f} tasks/s, {run.deadlocks} deadlocks"
        )
    return TenantRatioResult(settings, one, many, runs, logs)
