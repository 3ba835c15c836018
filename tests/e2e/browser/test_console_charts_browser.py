"""The tenant page's health charts and its paginated, filterable agents table, in Chromium.

The charts are fed by the real sampler (fleet/control/health_samples.py) over tasks
that really ran through claims and the result handler; the screenshots go to
``<screenshot dir>/charts/`` (docs/screenshots/charts/ with
CLOACINA_SCREENSHOT_DIR=docs/screenshots, see docs/console.md).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from agents.models import Agent
from fleet.console.health import per_minute, tick
from fleet.control.health_samples import sample_tenant_health
from fleet.models import TaskExecution, TaskStatus, TenantHealthSample
from tests.support.browser import login
from tests.support.console import PASSWORD, make_agent, with_password
from tests.support.factories import finish, publish_example, start

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

LIVE_UPDATE_S = 5  # partials poll every 0.5 s here (fast_polling); allow for a busy machine
HISTORY_MINUTES = 40


def _shot(page, selector: str, path) -> None:
    """A screenshot of one section, clipped from the whole page: the polled section is
    replaced every half second, so an element screenshot would lose its element."""
    box = page.evaluate(
        """s => { const r = document.querySelector(s).getBoundingClientRect();
                  return {x: r.x + scrollX, y: r.y + scrollY, width: r.width, height: r.height}; }""",
        selector,
    )
    page.screenshot(path=str(path), full_page=True, clip=box)


def _run_roots(tenant, n: int, outcome: str = "success") -> list[TaskExecution]:
    """Start ``n`` executions and apply one real outcome to each root task."""
    ran = []
    for _ in range(n):
        _, tasks = start(tenant, "etl", {})
        finish(tasks["extract"], outcome)
        ran.append(TaskExecution.objects.get(pk=tasks["extract"].pk))
    return ran


def _history(tenant, now) -> None:
    """Forty minutes of samples: the real sampler, minute by minute, over tasks that ran
    (their clocks moved back into that minute, as if they had run then)."""
    tasks = _run_roots(tenant, 3 * HISTORY_MINUTES)
    failed = _run_roots(tenant, HISTORY_MINUTES // 4, "failure")
    for minute in range(HISTORY_MINUTES, 0, -1):
        at = now - timedelta(minutes=minute)
        busy = 2 + (minute % 7 == 0) * 3  # a burst every seven minutes, slower to start
        for task in tasks[:busy]:
            latency = 0.05 + 0.4 * busy * (task.pk.int % 5) / 5
            TaskExecution.objects.filter(pk=task.pk).update(
                finished_at=at - timedelta(seconds=5),
                started_at=at - timedelta(seconds=10),
                ready_at=at - timedelta(seconds=10 + latency),
            )
        tasks = tasks[busy:]
        if minute % 4 == 0 and failed:
            # Its retries spent: the task failed for good in this minute.
            TaskExecution.objects.filter(pk=failed.pop().pk).update(
                status=TaskStatus.FAILED, finished_at=at - timedelta(seconds=3)
            )
        tenant.desired_count = 3 if minute > 25 else 4
        tenant.save(update_fields=["desired_count"])
        sample_tenant_health(at)
    # What the history did not use finished before it.
    long_ago = now - timedelta(hours=3)
    TaskExecution.objects.filter(pk__in=[t.pk for t in tasks + failed]).update(
        finished_at=long_ago, started_at=long_ago, ready_at=long_ago
    )


def test_health_charts_show_the_sampled_history_and_update_live(
    page, live_server, admin_user, tenant, screenshot_dir
):
    publish_example(tenant)
    for name in ("a1", "a2", "a3"):
        make_agent(tenant, name)
    now = timezone.now()
    _history(tenant, now)
    login(page, live_server, with_password(admin_user).username, PASSWORD)
    page.goto(f"{live_server.url}/console/tenants/acme/#health")
    health = page.locator("#tenant-health")
    for key in ("depth", "throughput", "latency", "agents"):
        expect(health.locator(f'figure[data-chart="{key}"] svg')).to_be_visible()
    agents = health.locator('figure[data-chart="agents"] svg')
    expect(agents).to_have_attribute("data-live-now", "3")
    expect(agents).to_have_attribute("data-desired-now", "4")
    throughput = health.locator('figure[data-chart="throughput"] svg')
    expect(throughput.locator("polyline.line-completed")).to_have_count(1)
    expect(throughput.locator("text.legend-label")).to_have_text(["failed", "completed"])
    expect(health.locator('figure[data-chart="latency"] svg text.unit')).to_have_text("ms")
    page.evaluate("window.__stillTheSamePage = true")

    # New work finishes and the sampler runs: the chart moves without a reload.
    for task in _run_roots(tenant, 6):
        TaskExecution.objects.filter(pk=task.pk).update(finished_at=timezone.now())
    make_agent(tenant, "a4")
    sample_tenant_health(timezone.now())
    window_s = TenantHealthSample.objects.filter(tenant=tenant).latest("at").window_s
    expect(agents).to_have_attribute("data-live-now", "4", timeout=LIVE_UPDATE_S * 1000)
    expect(throughput).to_have_attribute("data-completed-now", tick(per_minute(6, window_s)))
    assert page.evaluate("window.__stillTheSamePage === true"), "the page was reloaded"

    # Another range keeps itself across the polls.
    page.click('#tenant-health a[data-range="15m"]')
    expect(page.locator("#tenant-health a.current")).to_have_text("15m")
    shots = screenshot_dir / "charts"
    shots.mkdir(exist_ok=True)
    page.goto(f"{live_server.url}/console/tenants/acme/?range=1h#health")
    _shot(page, "#tenant-health", shots / "tenant-health.png")


def test_the_agents_table_pages_filters_and_sorts_in_the_browser(
    page, live_server, admin_user, tenant, screenshot_dir
):
    now = timezone.now()
    Agent.objects.bulk_create(
        Agent(
            tenant=tenant, name=f"agent-{i:03d}", target_triple="x86_64-unknown-linux-gnu",
            max_concurrency=4, in_flight=i % 5, connected_to="" if i % 10 == 2 else "test-server",
            state="draining" if i % 10 == 1 else "live", tags=["gpu"] if i % 2 else [],
            last_heartbeat=now,
        )
        for i in range(120)
    )  # fmt: skip
    login(page, live_server, with_password(admin_user).username, PASSWORD)
    page.goto(f"{live_server.url}/console/tenants/acme/#agents")
    table = page.locator("#tenant-agents")
    expect(table.locator("tbody tr")).to_have_count(25)
    expect(page.locator("#agents-pager")).to_contain_text("120 agents · page 1 of 5")

    page.click('#agents-pager a[rel="next"]')
    expect(page.locator("#agents-pager")).to_contain_text("page 2 of 5")
    expect(table.locator("tbody tr").first).to_have_attribute(
        "data-agent", "agent-028"
    )  # live first

    page.select_option('#agent-filters select[name="health"]', "unhealthy")
    page.fill('#agent-filters input[name="tag"]', "")
    page.click('#agent-filters button[type="submit"]')
    expect(page.locator("#agents-pager")).to_contain_text("12 agents matching")
    expect(table.locator("tbody tr")).to_have_count(12)
    expect(table.locator("tbody tr").first).to_contain_text("unhealthy")

    page.click('#tenant-agents a[data-sort="name"]')  # by name ▲ (the filter stays)
    page.click('#tenant-agents a[data-sort="name"]')  # by name ▼
    expect(table.locator("tbody tr").first).to_have_attribute("data-agent", "agent-112")
    expect(page.locator("#agents-pager")).to_contain_text("12 agents matching")

    # The polled table keeps the filter: a new unhealthy agent shows up without a reload.
    page.evaluate("window.__stillTheSamePage = true")
    make_agent(tenant, "agent-zz-new", connected_to="")
    expect(table.locator("tbody tr").first).to_have_attribute(
        "data-agent", "agent-zz-new", timeout=LIVE_UPDATE_S * 1000
    )
    expect(page.locator("#agents-pager")).to_contain_text("13 agents matching")
    assert page.evaluate("window.__stillTheSamePage === true"), "the page was reloaded"

    shots = screenshot_dir / "charts"
    shots.mkdir(exist_ok=True)
    page.goto(f"{live_server.url}/console/tenants/acme/?tag=gpu&sort=-in_flight#agents")
    expect(page.locator("#agents-pager")).to_contain_text("60 agents matching")
    _shot(page, "#agent-filters", shots / "agents-filter.png")
    _shot(page, "#tenant-agents", shots / "agents-table.png")
