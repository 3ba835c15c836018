"""Console pages and GET /api/v1/fleet with 500 tenants and 1,000 agents in one tenant.

Paging, filtering and sorting (REST and console), the queries each page costs (bounded:
the same with 3 agents or 1,000, with 2 tenants or 500) and, with ``-s``, the measured
p50 of each page (docs/console.md quotes them; timings are printed, never asserted).
"""

from __future__ import annotations

import statistics
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from agents.models import Agent
from fleet.bench.pages import agent_rows
from fleet.executors.fleet.routing import health
from fleet.models import (
    AgentPool,
    TaskExecution,
    TaskStatus,
    Tenant,
    WorkflowExecution,
    WorkflowStatus,
)
from fleet.platform.config import get_config
from tests.support.console import make_agent
from tests.support.factories import publish_example
from tests.support.keys import bearer

BIG_TENANTS = 500
BIG_AGENTS = 1000
BIG_EXECUTIONS = 1000
FLEET_TENANTS, FLEET_AGENTS = 120, 400


def _agent_rows(tenant, n: int) -> list[Agent]:
    """``n`` agents of every health (fleet.bench.pages.agent_rows: a tenth each dead, draining,
    without a socket and late), late ones just past the degraded threshold."""
    config = get_config()
    late = timezone.now() - timedelta(
        seconds=health.degraded_after_s(config.heartbeat_interval_s) + 1
    )
    return agent_rows(tenant, n, late=late, connected_to="test-server", name_width=4)


def _executions(tenant, n: int) -> None:
    package = publish_example(tenant)
    now = timezone.now()
    executions = WorkflowExecution.objects.bulk_create(
        WorkflowExecution(
            tenant=tenant, package=package, workflow_name="etl",
            status=WorkflowStatus.COMPLETED if i % 3 else WorkflowStatus.RUNNING,
            created_at=now - timedelta(seconds=i),
        )
        for i in range(n)
    )  # fmt: skip
    TaskExecution.objects.bulk_create(
        TaskExecution(
            workflow_execution=e, tenant=tenant, task_name=name, function=f"etl.{name}",
            status=TaskStatus.COMPLETED, finished_at=now,
        )
        for e in executions
        for name in ("extract", "transform", "load")
    )  # fmt: skip


def _build(tenant, tenants: int, agents: int, executions: int):
    """``tenants`` tenants (acme and others with 2 agents each), ``agents`` agents in acme."""
    others = Tenant.objects.bulk_create(
        Tenant(name=f"tenant-{i:03d}", desired_count=i % 3) for i in range(tenants - 1)
    )
    Agent.objects.bulk_create(
        [*_agent_rows(tenant, agents), *(a for t in others for a in _agent_rows(t, 2))],
        batch_size=2000,
    )
    AgentPool.objects.create(tenant=tenant, name="big")
    _executions(tenant, executions)
    return tenant


@pytest.fixture
def big_fleet(tenant):
    """The data set of issue 16/18: 500 tenants, 1,000 agents in acme, 1,000 executions."""
    return _build(tenant, BIG_TENANTS, BIG_AGENTS, BIG_EXECUTIONS)


@pytest.fixture
def fleet(tenant):
    """Enough for several pages of everything, quicker to build: 120 tenants, 400 agents."""
    return _build(tenant, FLEET_TENANTS, FLEET_AGENTS, 10)


@pytest.fixture
def small_fleet(tenant, other_tenant):
    Agent.objects.bulk_create(_agent_rows(tenant, 3))
    AgentPool.objects.create(tenant=tenant, name="big")
    _executions(tenant, 3)
    return tenant


def _fleet(client, key, **params):
    response = client.get("/api/v1/fleet", params, **bearer(key))
    assert response.status_code == 200, response.content
    return response.json()


# --- GET /api/v1/fleet: pages, filters, sort ------------------------------------------------


def test_the_default_fleet_is_the_first_100_by_name_with_every_total(client, fleet, read_key):
    body = _fleet(client, read_key)
    names = [a["name"] for a in body["agents"]]
    assert names == [f"agent-{i:04d}" for i in range(100)]
    assert (body["limit"], body["offset"], body["next_offset"]) == (100, 0, 100)
    assert body["agents_count"] == FLEET_AGENTS  # the recently dead are listed too
    assert body["agents_live"] == 320 and body["agents_draining"] == 40
    assert body["agents_total"] == 360
    last = _fleet(client, read_key, offset=300)
    assert len(last["agents"]) == 100 and last["next_offset"] is None
    assert [a["name"] for a in _fleet(client, read_key, offset=399)["agents"]] == ["agent-0399"]


def test_the_fleet_filters_by_state_health_tag_and_pool(client, fleet, read_key):
    def names(**params) -> list[str]:
        body = _fleet(client, read_key, limit=500, **params)
        assert body["agents_count"] == len(body["agents"]) or body["next_offset"] is not None
        return [a["name"] for a in body["agents"]]

    assert len(names(state="draining")) == 40
    unhealthy = _fleet(client, read_key, health="unhealthy", limit=500)
    assert unhealthy["agents_count"] == 40
    assert {a["health"] for a in unhealthy["agents"]} == {"unhealthy"}
    assert {a["health"] for a in _fleet(client, read_key, health="degraded")["agents"]} == {
        "degraded"
    }
    assert _fleet(client, read_key, health="healthy")["agents_count"] == 240
    gpu = _fleet(client, read_key, tag="gpu", state="live")
    assert gpu["agents_count"] == 160 and all("gpu" in a["tags"] for a in gpu["agents"])
    big = _fleet(client, read_key, pool="big", limit=500)
    assert big["agents_count"] == 100 and all("pool:big" in a["tags"] for a in big["agents"])
    default = _fleet(client, read_key, pool="default", limit=500)
    assert default["agents_count"] == 300
    assert not any("pool:big" in a["tags"] for a in default["agents"])


def test_the_fleet_sorts_and_reverses(client, fleet, read_key):
    by_load = _fleet(client, read_key, sort="-in_flight", limit=5)["agents"]
    assert [a["in_flight"] for a in by_load] == [4] * 5
    assert [a["name"] for a in by_load] == sorted(a["name"] for a in by_load)  # ties by name
    worst = _fleet(client, read_key, sort="-health", limit=1)["agents"][0]
    assert worst["health"] == "dead"
    best = _fleet(client, read_key, sort="health", limit=1)["agents"][0]
    assert best["health"] == "healthy"
    assert _fleet(client, read_key, sort="-name", limit=1)["agents"][0]["name"] == "agent-0399"
    # Paging through a sort visits every agent once.
    seen = []
    for offset in range(0, FLEET_AGENTS, 300):
        seen += [a["name"] for a in _fleet(client, read_key, sort="last_heartbeat",
                                           limit=300, offset=offset)["agents"]]  # fmt: skip
    assert len(seen) == len(set(seen)) == FLEET_AGENTS


@pytest.mark.parametrize(
    ("params", "status", "words"),
    [
        ({"limit": 0}, 422, "limit"),
        ({"limit": 501}, 422, "limit"),
        ({"offset": -1}, 422, "offset"),
        ({"state": "zombie"}, 422, "state"),
        ({"health": "fine"}, 422, "health"),
        ({"sort": "colour"}, 422, "sort"),
        ({"tag": "x" * 201}, 422, "tag"),
        ({"pool": "nope"}, 404, "unknown pool 'nope'"),
    ],
)
def test_bad_fleet_params_are_refused_naming_the_problem(
    client, small_fleet, read_key, params, status, words
):
    response = client.get("/api/v1/fleet", params, **bearer(read_key))
    assert response.status_code == status, response.content
    assert words in str(response.json()["detail"])


def test_filters_never_reach_another_tenants_agents(client, tenant, other_tenant, read_key):
    make_agent(other_tenant, "theirs", tags=["gpu", "pool:big"])
    AgentPool.objects.create(tenant=other_tenant, name="big")
    for params in ({"tag": "gpu"}, {"state": "live"}, {"health": "healthy"}, {"sort": "-name"}):
        body = _fleet(client, read_key, **params)
        assert body["agents"] == [] and body["agents_count"] == 0
    # Another tenant's pool is unknown here, exactly like a pool nobody has.
    theirs = client.get("/api/v1/fleet", {"pool": "big"}, **bearer(read_key))
    nobody = client.get("/api/v1/fleet", {"pool": "nobody"}, **bearer(read_key))
    assert (theirs.status_code, nobody.status_code) == (404, 404)
    assert theirs.json()["detail"].replace("big", "X") == nobody.json()["detail"].replace(
        "nobody", "X"
    )


def test_health_filters_agree_with_classify_at_every_boundary(tenant):
    """health_q (SQL) and classify (Python) put every agent in the same class."""
    config, now = get_config(), timezone.now()
    degraded_s = health.degraded_after_s(config.heartbeat_interval_s)
    ages = sorted({0, degraded_s - 1, degraded_s + 1, config.liveness_window_s - 1,
                   config.liveness_window_s + 1, 3600})  # fmt: skip
    i = 0
    for state in ("live", "draining", "dead", "stopped"):
        for connected in ("", "s1"):
            for age in ages:
                make_agent(tenant, f"a{i}", state=state, connected_to=connected,
                           last_heartbeat=now - timedelta(seconds=age))  # fmt: skip
                i += 1
    agents = list(Agent.objects.filter(tenant=tenant))
    for cls in health.Health:
        by_sql = set(
            Agent.objects.filter(tenant=tenant)
            .filter(
                health.health_q(cls, now, config.heartbeat_interval_s, config.liveness_window_s)
            )  # fmt: skip
            .values_list("name", flat=True)
        )
        by_python = {
            a.name for a in agents
            if health.classify(a.state, a.connected_to, a.last_heartbeat, now,
                               config.heartbeat_interval_s, config.liveness_window_s) == cls
        }  # fmt: skip
        assert by_sql == by_python, cls


# --- the console: the agents table and the overview -----------------------------------------


def _agent_names(body: str) -> list[str]:
    return [part.split('"')[0] for part in body.split('data-agent="')[1:]]


def test_the_agents_table_pages_filters_and_sorts(admin_client, fleet):
    first = admin_client.get("/console/tenants/acme/partials/agents/").content.decode()
    names = _agent_names(first)
    assert len(names) == 25 and names[0] == "agent-0002"  # live first, then by name
    assert "400 agents · page 1 of 16" in first
    assert 'rel="next"' in first and 'rel="prev"' not in first
    page3 = admin_client.get("/console/tenants/acme/partials/agents/?page=3").content.decode()
    assert len(_agent_names(page3)) == 25 and not set(_agent_names(page3)) & set(names)
    assert 'rel="prev"' in page3
    none = admin_client.get(
        "/console/tenants/acme/partials/agents/?health=unhealthy&tag=gpu"
    ).content.decode()
    # unhealthy agents (i % 10 == 2) are all even, gpu ones all odd: nothing matches both.
    assert _agent_names(none) == [] and "No agent matches this filter." in none
    healthy = admin_client.get(
        "/console/tenants/acme/partials/agents/?health=healthy&sort=-name"
    ).content.decode()
    listed = _agent_names(healthy)
    assert listed[0] == "agent-0399" and listed == sorted(listed, reverse=True)
    assert "240 agents matching · page 1 of 10" in healthy
    # The next page keeps the filter and the sort, and so does the poll.
    assert "health=healthy&amp;sort=-name&amp;page=2" in healthy
    assert "partials/agents/?health=healthy&amp;sort=-name&amp;page=1" in healthy
    pool = admin_client.get("/console/tenants/acme/partials/agents/?pool=big").content.decode()
    assert "100 agents matching" in pool
    # Each row's health note (worked out per row in Python, not by template conditions).
    unhealthy = admin_client.get(
        "/console/tenants/acme/partials/agents/?health=unhealthy"
    ).content.decode()
    assert (
        unhealthy.count('<span class="small cell-bad" title="no socket or no recent heartbeat')
        == 25
    )
    degraded = admin_client.get(
        "/console/tenants/acme/partials/agents/?health=degraded"
    ).content.decode()
    assert degraded.count('<span class="small cell-warn" title="heartbeat older than 2') == 25
    assert "level-warn" in degraded and "cell-bad" not in degraded


def test_the_agents_table_refuses_bad_filters_and_clamps_a_stale_page(admin_client, small_fleet):
    for query, status, words in (
        ("state=zombie", 422, "state must be one of"),
        ("sort=colour", 422, "sort must be one of"),
        ("pool=nope", 404, "unknown pool"),
        ("page=0", 400, "page must be"),
    ):
        response = admin_client.get(f"/console/tenants/acme/partials/agents/?{query}")
        assert response.status_code == status, (query, response.status_code)
        assert words in response.content.decode()
    stale = admin_client.get("/console/tenants/acme/partials/agents/?page=9").content.decode()
    assert len(_agent_names(stale)) == 3  # the last page, not an error, while polling


def test_the_tenant_page_carries_the_filter_form_and_sort_links(admin_client, small_fleet):
    body = admin_client.get("/console/tenants/acme/?state=live&sort=name").content.decode()
    assert 'id="agent-filters"' in body and '<option value="live" selected>' in body
    assert '<option value="big"' in body  # the tenant's pools
    # Clicking the current sort column reverses it; the filter stays.
    assert 'href="?state=live&amp;sort=-name#agents"' in body
    assert 'href="?state=live&amp;sort=health#agents"' in body


def test_the_overview_pages_its_tenants_trouble_first(admin_client, fleet):
    body = admin_client.get("/console/").content.decode()
    rows = [p.split('"')[0] for p in body.split('data-tenant="')[1:]]
    assert len(rows) == 50
    assert "of 120 tenants need attention" in body and "page 1 of 3" in body
    # Trouble first: tenants missing desired agents come before the healthy ones.
    levels = [p.split('"')[0] for p in body.split('<tr class="level-')[1:]]
    assert levels == sorted(levels, key=lambda lv: {"bad": 0, "warn": 1, "ok": 2}[lv])
    named = admin_client.get("/console/?q=tenant-01&sort=name").content.decode()
    rows = [p.split('"')[0] for p in named.split('data-tenant="')[1:]]
    assert rows == [f"tenant-{i:03d}" for i in range(10, 20)]
    assert "10 tenants matching" in named
    ok = admin_client.get("/console/partials/overview/?level=ok").content.decode()
    assert 'class="level-bad"' not in ok and 'class="level-warn"' not in ok
    assert admin_client.get("/console/?level=purple").status_code == 400


# --- queries per page: bounded, the same for a small fleet and a big one --------------------

PAGES = {
    "GET /api/v1/fleet": ("api", "/api/v1/fleet"),
    "GET /api/v1/fleet?health=unhealthy&sort=-last_heartbeat": (
        "api", "/api/v1/fleet?health=unhealthy&sort=-last_heartbeat&limit=500",
    ),
    "GET /api/v1/fleet?pool=big&tag=gpu": ("api", "/api/v1/fleet?pool=big&tag=gpu"),
    "console tenant page": ("console", "/console/tenants/acme/"),
    "console tenant agents table": (
        "console", "/console/tenants/acme/partials/agents/?health=healthy&sort=-in_flight",
    ),
    "console tenant health charts": ("console", "/console/tenants/acme/partials/health/"),
    "console overview": ("console", "/console/"),
    "console overview rows": ("console", "/console/partials/overview/?page=3"),
    "console executions": ("console", "/console/executions/"),
}  # fmt: skip
# What each page may cost: sessions, auth and the page's own grouped queries.
QUERIES_MAX = 40


def _get(admin_client, client, read_key, kind: str, url: str):
    if kind == "api":
        return client.get(url, **bearer(read_key))
    return admin_client.get(url)


def _query_counts(admin_client, client, read_key) -> dict[str, int]:
    counts = {}
    for name, (kind, url) in PAGES.items():
        _get(admin_client, client, read_key, kind, url)  # warm caches (config, sessions)
        with CaptureQueriesContext(connection) as queries:
            response = _get(admin_client, client, read_key, kind, url)
        assert response.status_code == 200, (name, response.content[:300])
        counts[name] = len(queries)
    return counts


def test_queries_per_page_do_not_grow_with_the_fleet(
    admin_client, client, read_key, tenant, other_tenant, django_db_blocker
):
    Agent.objects.bulk_create(_agent_rows(tenant, 3))
    AgentPool.objects.create(tenant=tenant, name="big")
    _executions(tenant, 3)
    small = _query_counts(admin_client, client, read_key)
    Tenant.objects.bulk_create(Tenant(name=f"tenant-{i:03d}") for i in range(BIG_TENANTS - 2))
    Agent.objects.bulk_create(
        [a for i, a in enumerate(_agent_rows(tenant, BIG_AGENTS + 3)) if i >= 3], batch_size=2000
    )
    WorkflowExecution.objects.bulk_create(
        WorkflowExecution(tenant=tenant, package_id=WorkflowExecution.objects.first().package_id,
                          workflow_name="etl")
        for _ in range(BIG_EXECUTIONS)
    )  # fmt: skip
    big = _query_counts(admin_client, client, read_key)
    assert big == small, {k: (small[k], big[k]) for k in small if small[k] != big[k]}
    assert max(big.values()) <= QUERIES_MAX, big


def _statements(fetch) -> list[str]:
    fetch()  # warm caches (config, sessions, the API key)
    with CaptureQueriesContext(connection) as queries:
        fetch()
    return [q["sql"] for q in queries.captured_queries]


def _reading(table: str, statements: list[str]) -> list[str]:
    return [s for s in statements if f'FROM "{table}"' in s]


def test_get_fleet_reads_the_tenant_once_and_pages_in_one_statement(client, fleet, read_key):
    """The key cache's tenant carries few fields: reading the others one query each cost
    three statements; the page's total rides on its rows (count(*) OVER ())."""
    statements = _statements(lambda: _fleet(client, read_key))
    assert len(_reading("fleet_tenant", statements)) == 1, statements
    assert len(_reading("agents_agent", statements)) == 2, statements  # the page, the counts
    body = _fleet(client, read_key, offset=350)
    assert (len(body["agents"]), body["agents_count"]) == (50, FLEET_AGENTS)
    past = _fleet(client, read_key, offset=FLEET_AGENTS + 50)  # past the end: counted apart
    assert (past["agents"], past["agents_count"]) == ([], FLEET_AGENTS)
    none = _fleet(client, read_key, tag="nobody-has-this")
    assert (none["agents"], none["agents_count"]) == ([], 0)


def test_the_tenant_page_reads_the_outbox_pools_and_tenant_once_each(admin_client, fleet):
    statements = _statements(lambda: admin_client.get("/console/tenants/acme/"))
    # The fleet card's ages and open count in one grouped query; the health card's own.
    assert len(_reading("delivery_outbox", statements)) == 2, statements
    assert len(_reading("fleet_agentpool", statements)) == 1, statements
    assert len(_reading("fleet_tenant", statements)) == 1, statements
    # The agents table: one statement for the page and its total.
    assert len(_reading("agents_agent", statements)) == 3, statements  # + fleet, pools counts


def _longest_statement(admin_client, url: str) -> int:
    admin_client.get(url)  # warm caches (config, sessions)
    with CaptureQueriesContext(connection) as queries:
        assert admin_client.get(url).status_code == 200
    return max(len(q["sql"]) for q in queries.captured_queries)


def test_the_overviews_statements_do_not_grow_with_the_tenants(admin_client, tenant, other_tenant):
    """The visible tenants reach the overview's grouped queries as a subquery: 500 tenants
    must not mean 500 bound ids in each statement (binding them cost more than the query)."""
    small = _longest_statement(admin_client, "/console/")
    Tenant.objects.bulk_create(Tenant(name=f"tenant-{i:03d}") for i in range(BIG_TENANTS - 2))
    big = _longest_statement(admin_client, "/console/")
    assert big < small + 200, (small, big)


def test_page_times_at_scale(admin_client, client, read_key, big_fleet):
    """Prints the p50 of 15 requests per page (run with -s); docs/console.md quotes them.

    Wall time includes PostgreSQL; CPU is this process's own (the view, the ORM, the
    templates), which other load on the machine distorts less.
    """
    pages = {
        **PAGES,
        # For comparison: one page as large as allowed, the nearest to the old unpaged list.
        "GET /api/v1/fleet?limit=500": ("api", "/api/v1/fleet?limit=500"),
    }
    lines = []
    for name, (kind, url) in pages.items():
        _get(admin_client, client, read_key, kind, url)
        walls, cpus = [], []
        for _ in range(15):
            wall, cpu = time.perf_counter(), time.process_time()
            response = _get(admin_client, client, read_key, kind, url)
            walls.append((time.perf_counter() - wall) * 1000)
            cpus.append((time.process_time() - cpu) * 1000)
            assert response.status_code == 200
        lines.append(f"  {name:<58} p50 {statistics.median(walls):6.1f} ms wall, "
                     f"{statistics.median(cpus):6.1f} ms CPU")  # fmt: skip
    print(f"\npage times, {BIG_TENANTS} tenants, {BIG_AGENTS} agents in acme:\n" + "\n".join(lines))
