"""The pages phase: ``fleetbench --pages N``.

A real ``serve`` on the bench database, one tenant holding N agents (seeded as rows: a
tenth each recently dead, draining, without a socket and late, the rest healthy, as
tests/integration/test_console_at_scale.py seeds them), a member of that tenant logged in
through the console's login form, and a read key.  Each page below is requested over one
keep-alive HTTP connection, a few times to warm up and then ``requests`` times; printed
per page: p50 and p95 of the wall time of a request (the client's clock: HTTP, Django,
PostgreSQL) and the server's CPU per request (from /proc, less what the idle server used
in the same time; the machine's other load inflates it far less than the wall time).  Issue 16's target: ``GET /api/v1/fleet`` and the tenant page with 1,000
agents in a tenant, p50 ≤ 50 ms.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import httpx
import psutil
from django.contrib.auth import get_user_model
from django.utils import timezone

from agents.models import Agent
from agents.protocol.triples import host_triple
from fleet.bench.server import BenchServer
from fleet.models import AgentPool, ApiKey, Tenant
from fleet.platform.tenancy import TenantMembership

TENANT = "pages"
USER = "pages-bench"
PASSWORD = "pages-bench-password-1"  # a throwaway user of the flushed bench database
WARMUP = 5
IDLE_S = 3.0  # how long the idle server's own CPU use is measured before the pages
# The agents keep the health the seed gave them: nothing beats and the sweeper must not
# evict them while the pages are measured.
HEARTBEAT_S = 3600
PAGES: tuple[tuple[str, str, str], ...] = (
    ("GET /api/v1/fleet (100 agents a page)", "api", "/api/v1/fleet"),
    ("GET /api/v1/fleet?health=unhealthy&sort=-last_heartbeat", "api",
     "/api/v1/fleet?health=unhealthy&sort=-last_heartbeat"),
    ("console tenant page (whole page)", "console", f"/console/tenants/{TENANT}/"),
    ("console tenant agents table (polled partial)", "console",
     f"/console/tenants/{TENANT}/partials/agents/"),
    ("console tenant health charts (polled partial)", "console",
     f"/console/tenants/{TENANT}/partials/health/"),
)  # fmt: skip


@dataclass
class PageTimes:
    name: str
    wall_ms: list[float] = field(default_factory=list)
    server_cpu_ms: float = 0.0  # per request

    def percentile(self, q: int) -> float:
        ordered = sorted(self.wall_ms)
        if len(ordered) == 1:
            return ordered[0]
        return statistics.quantiles(ordered, n=100, method="inclusive")[q - 1]


@dataclass
class PagesResult:
    agents: int
    requests: int
    pages: list[PageTimes]

    def table(self) -> str:
        width = max(len(p.name) for p in self.pages)
        head = f"{'page'.ljust(width)}  {'p50 ms':>7}  {'p95 ms':>7}  {'server CPU ms':>13}"
        lines = [
            f"fleetbench: pages, {self.agents} agents in tenant {TENANT!r}, "
            f"{self.requests} requests a page over one keep-alive connection",
            head,
            "-" * len(head),
        ]
        for p in self.pages:
            lines.append(
                f"{p.name.ljust(width)}  {p.percentile(50):>7.1f}  {p.percentile(95):>7.1f}  "
                f"{p.server_cpu_ms:>13.1f}"
            )
        return "\n".join(lines)


def agent_rows(
    tenant: Tenant, count: int, *, late: datetime, connected_to: str, name_width: int = 5
) -> list[Agent]:
    """``count`` unsaved agents of every health: a tenth each recently dead, draining,
    without a socket (unhealthy) and late (last beat at ``late``: degraded), the rest
    healthy and connected to ``connected_to``.  Odd ones tagged ``gpu``, every fourth in
    pool ``big``.  (tests/integration/test_console_at_scale.py seeds its fleets with it.)"""
    now = timezone.now()
    rows = []
    for i in range(count):
        kind = i % 10
        rows.append(
            Agent(
                tenant=tenant,
                name=f"agent-{i:0{name_width}d}",
                state={0: "dead", 1: "draining"}.get(kind, "live"),
                dead_at=now - timedelta(minutes=1) if kind == 0 else None,
                connected_to="" if kind == 2 else connected_to,
                last_heartbeat=late if kind == 3 else now,
                target_triple=host_triple(),
                max_concurrency=4,
                in_flight=i % 5,
                tags=(["gpu"] if i % 2 else []) + (["pool:big"] if i % 4 == 0 else []),
            )
        )
    return rows


def seed_agents(tenant: Tenant, count: int) -> None:
    """``count`` agents of every health (:func:`agent_rows`) and the pool ``big``."""
    late = timezone.now() - timedelta(seconds=2 * HEARTBEAT_S)
    rows = agent_rows(tenant, count, late=late, connected_to="bench-elsewhere")
    Agent.objects.bulk_create(rows, batch_size=2000)
    AgentPool.objects.create(tenant=tenant, name="big")


def _member(tenant: Tenant) -> None:
    user = get_user_model().objects.create_user(USER, None, PASSWORD)
    TenantMembership.objects.create(user=user, tenant=tenant, role="read")


def _logged_in(url: str) -> httpx.Client:
    """A keep-alive client holding a console session (the login form, CSRF and all)."""
    browser = httpx.Client(base_url=url, timeout=30)
    browser.get("/console/login/")
    csrf = next(c.value for c in browser.cookies.jar if c.name == "csrftoken")
    response = browser.post(
        "/console/login/",
        data={"username": USER, "password": PASSWORD},
        headers={"Referer": f"{url}/console/login/", "X-CSRFToken": csrf},
    )
    if response.status_code != 302:
        raise RuntimeError(f"console login failed: {response.status_code} {response.text[:300]}")
    return browser


def _cpu_s(server: psutil.Process) -> float:
    times = server.cpu_times()
    return times.user + times.system


def idle_cpu_rate(server: psutil.Process, seconds: float = IDLE_S) -> float:
    """The server's CPU seconds per second with no request (its loops and sweeps)."""
    cpu, started = _cpu_s(server), time.perf_counter()
    time.sleep(seconds)
    return (_cpu_s(server) - cpu) / (time.perf_counter() - started)


def _time_page(
    client: httpx.Client, server: psutil.Process, idle_rate: float, page: tuple[str, str, str],
    requests: int,
) -> PageTimes:  # fmt: skip
    name, _kind, path = page
    for _ in range(WARMUP):
        client.get(path).raise_for_status()
    times = PageTimes(name)
    cpu_before, wall_before = _cpu_s(server), time.perf_counter()
    for _ in range(requests):
        started = time.perf_counter()
        response = client.get(path)
        times.wall_ms.append(1000.0 * (time.perf_counter() - started))
        if response.status_code != 200:
            raise RuntimeError(f"{path}: {response.status_code} {response.text[:300]}")
    # The server's own loops ran meanwhile: their share is taken off.
    busy = _cpu_s(server) - cpu_before - idle_rate * (time.perf_counter() - wall_before)
    times.server_cpu_ms = max(0.0, 1000.0 * busy / requests)
    return times


def run_pages_bench(database_url: str, agents: int, requests: int) -> PagesResult:
    """Seed, start ``serve``, time every page of :data:`PAGES` (see the module docstring)."""
    tenant = Tenant.objects.create(name=TENANT)
    seed_agents(tenant, agents)
    _member(tenant)
    read_key = ApiKey.mint("read", tenant=tenant, label="fleetbench pages")[1]
    env = {"CLOACINA_AGENT_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S)}
    with BenchServer(database_url, "fleet", **env) as server:
        assert server.process is not None  # started by the with
        process = psutil.Process(server.process.pid)
        clients = {
            "api": httpx.Client(
                base_url=server.url,
                headers={"Authorization": f"Bearer {read_key}"},
                timeout=30,
            ),
            "console": _logged_in(server.url),
        }
        try:
            idle_rate = idle_cpu_rate(process)
            pages = [
                _time_page(clients[page[1]], process, idle_rate, page, requests) for page in PAGES
            ]
        finally:
            for client in clients.values():
                client.close()
    return PagesResult(agents, requests, pages)
