"""Per-tenant health samples (fleet/control/health_samples.py) and the tenant page's charts.

Here: the integration tests (database, in-process client); the SVG drawing itself is
unit-tested in tests/unit/test_console_charts.py, the live page in the browser tests.
"""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from fleet.control.health_samples import (
    MAX_WINDOW_S,
    prune_health_samples,
    sample_tenant_health,
)
from fleet.models import TaskExecution, TaskStatus, TenantHealthSample
from tests.support.console import make_agent
from tests.support.factories import publish_example, start


def _finished(task, status: str, latency_s: float, finished_s_ago: float, now) -> None:
    """Mark ``task`` finished ``finished_s_ago`` seconds before ``now``, started latency_s after Ready."""
    finished = now - timedelta(seconds=finished_s_ago)
    started = finished - timedelta(seconds=1)
    TaskExecution.objects.filter(pk=task.pk).update(
        status=status,
        ready_at=started - timedelta(seconds=latency_s),
        started_at=started,
        finished_at=finished,
    )


def _four_tasks(tenant):
    publish_example(tenant)
    return start(tenant, "etl", {})[1]


def test_a_sample_counts_the_window_s_finished_tasks_their_latency_and_the_agents(
    tenant, other_tenant
):
    tasks = _four_tasks(tenant)
    now = timezone.now()
    _finished(tasks["extract"], TaskStatus.COMPLETED, 1.0, 10, now)
    _finished(tasks["transform_a"], TaskStatus.COMPLETED, 2.0, 20, now)
    _finished(tasks["transform_b"], TaskStatus.FAILED, 3.0, 30, now)
    _finished(tasks["load"], TaskStatus.COMPLETED, 50.0, 600, now)  # before the window
    make_agent(tenant, "a1")
    make_agent(tenant, "a2", state="dead")
    tenant.desired_count = 3
    tenant.save(update_fields=["desired_count"])

    assert sample_tenant_health(now) == 2  # every active tenant, zeros included
    acme = TenantHealthSample.objects.get(tenant=tenant)
    assert (acme.completed, acme.failed, acme.agents_live, acme.desired_count) == (2, 1, 1, 3)
    assert acme.window_s == 60.0
    assert acme.latency_p50_s == 2.0
    assert 2.8 < acme.latency_p95_s <= 3.0
    globex = TenantHealthSample.objects.get(tenant=other_tenant)
    assert (globex.completed, globex.failed, globex.latency_p50_s) == (0, 0, None)


def test_windows_chain_so_no_task_is_counted_twice_or_missed(tenant):
    tasks = _four_tasks(tenant)
    first = timezone.now() - timedelta(seconds=200)
    _finished(tasks["extract"], TaskStatus.COMPLETED, 1.0, 30, first)
    sample_tenant_health(first)
    # 90 s later (a late tick): the window is the 90 s since the last sample, not 60.
    second = first + timedelta(seconds=90)
    _finished(tasks["transform_a"], TaskStatus.COMPLETED, 1.0, 80, second)
    sample_tenant_health(second)
    # After a long gap the window is capped, so an hour is not lumped into one minute.
    third = second + timedelta(hours=1)
    sample_tenant_health(third)
    rows = list(TenantHealthSample.objects.filter(tenant=tenant).order_by("at"))
    assert [(r.completed, r.window_s) for r in rows] == [(1, 60.0), (1, 90.0), (0, MAX_WINDOW_S)]
    assert sample_tenant_health(third) == 0  # the same instant twice writes nothing


def test_old_samples_are_pruned(tenant):
    now = timezone.now()
    for days in (10, 8, 1):
        TenantHealthSample.objects.create(tenant=tenant, at=now - timedelta(days=days), window_s=60)
    assert prune_health_samples(retention_s=7 * 24 * 3600, batch=1) == 2
    assert TenantHealthSample.objects.count() == 1


def _samples(tenant, minutes: int, **values):
    now = timezone.now()
    TenantHealthSample.objects.bulk_create(
        TenantHealthSample(tenant=tenant, at=now - timedelta(minutes=m), window_s=60, **values)
        for m in range(minutes, 0, -1)
    )


def test_the_tenant_page_draws_four_charts_with_axes_units_and_legends(
    admin_client, tenant, other_tenant
):
    _samples(tenant, 30, completed=12, failed=3, latency_p50_s=0.04, latency_p95_s=0.25,
             agents_live=4, desired_count=5)  # fmt: skip
    _samples(other_tenant, 30, completed=999, agents_live=99, desired_count=99)
    body = admin_client.get("/console/tenants/acme/").content.decode()
    section = body[body.index('id="tenant-health"') :]
    for key in ("depth", "throughput", "latency", "agents"):
        assert f'data-chart="{key}"' in section
    assert 'data-completed-now="12" data-failed-now="3"' in section
    assert 'data-p95-now="250"' in section and ">ms</text>" in section  # in ms below 2 s
    assert 'data-live-now="4" data-desired-now="5"' in section
    assert ">tasks / min</text>" in section and ">agents</text>" in section
    labels = [
        part.split(">")[1].split("<")[0] for part in section.split('class="axis legend-label"')[1:]
    ]
    assert labels == ["pending", "delivered", "failed", "completed", "p95", "p50", "live",
                      "desired_count"]  # fmt: skip
    assert "99" not in section.split("</section>")[0].split('data-chart="agents"')[1]


def test_the_health_partial_keeps_its_range_and_refuses_a_bad_one(admin_client, tenant):
    _samples(tenant, 120, completed=6, agents_live=1, desired_count=1)
    part = admin_client.get("/console/tenants/acme/partials/health/?range=15m").content.decode()
    assert "partials/health/?range=15m" in part  # the poll keeps the range
    # The samples 14..1 minutes old are in range (the 15-minute one fell out just before
    # the request): 14 points on the completed line, not 120.
    line = part.split('class="line-completed" points="')[1].split('"')[0]
    assert len(line.split()) == 14
    bad = admin_client.get("/console/tenants/acme/partials/health/?range=2y")
    assert bad.status_code == 400 and "range must be one of" in bad.content.decode()


def test_slow_latency_reads_in_seconds_and_gaps_stay_gaps(admin_client, tenant):
    _samples(tenant, 3, latency_p50_s=4.0, latency_p95_s=9.5)
    now = timezone.now()
    TenantHealthSample.objects.create(tenant=tenant, at=now - timedelta(seconds=150), window_s=60)
    part = admin_client.get("/console/tenants/acme/partials/health/").content.decode()
    latency = part.split('data-chart="latency"')[1].split("</figure>")[0]
    assert ">seconds</text>" in latency and 'data-p95-now="9.5"' in latency
    # The sample without finished tasks splits each latency line in two: the lone sample
    # before it is a dot, the two after it a line.
    assert latency.count('class="line-p95" points=') == 1
    assert latency.count('<circle class="dot line-p95"') == 1
