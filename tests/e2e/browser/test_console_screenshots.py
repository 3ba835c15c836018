"""Screenshots of the main console pages on a realistic fleet, for docs/console.md.

Runs with the browser tests (it also checks the pages render without a script
error); the images go to a temporary directory unless CLOACINA_SCREENSHOT_DIR
names one (``CLOACINA_SCREENSHOT_DIR=docs/screenshots`` refreshes the docs).
"""

from __future__ import annotations

import math
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from agents.models import Agent
from fleet.control import limits
from fleet.models import (
    AutoscaleDecision,
    DeliveryOutbox,
    FleetChange,
    OutboxDepthSample,
    TaskExecution,
    Tenant,
)
from tests.support.browser import login
from tests.support.console import (
    PASSWORD,
    make_agent,
    make_eviction,
    make_outbox_row,
    with_password,
)
from tests.support.factories import finish, publish_example, start, tasks_of

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

WEDGED_PACKETS = 6
PAGES = {
    "overview": "/console/",
    "tenant": "/console/tenants/acme/",
    "evictions": "/console/evictions/",
    "outbox": "/console/outbox/",
    "executions": "/console/executions/",
}


def _ago(**kw) -> timezone.datetime:
    return timezone.now() - timedelta(**kw)


def _build_fleet() -> dict:
    """acme busy and healthy-ish, globex in trouble (no agents, wedged outbox), initech idle."""
    acme = Tenant.objects.create(name="acme")
    globex = Tenant.objects.create(name="globex")
    initech = Tenant.objects.create(name="initech")
    limits.set_fleet_overrides(acme, "admin:root", max_agents_override=6)
    for _ in range(3):
        limits.provision(acme, "console:wendy")
    limits.provision(globex, "console:otto")
    limits.provision(globex, "console:otto")
    limits.provision(initech, "console:ivan")

    version = {"version": "0.4.2"}
    a1 = make_agent(acme, "acme-agent-1", in_flight=3, max_concurrency=4, **version)
    a2 = make_agent(acme, "acme-agent-2", in_flight=2, max_concurrency=4, **version)
    make_agent(
        acme,
        "acme-agent-3",
        in_flight=1,
        max_concurrency=4,
        last_heartbeat=_ago(seconds=24),
        **version,
    )
    make_agent(acme, "acme-agent-0", state="draining", in_flight=1, max_concurrency=4, **version)
    dead = make_agent(acme, "acme-agent-9", state="dead", dead_at=_ago(minutes=12),
                      last_heartbeat=_ago(minutes=13), connected_to="", **version)  # fmt: skip
    make_agent(initech, "initech-agent-1", max_concurrency=2, **version)
    g_dead = make_agent(globex, "globex-agent-1", state="dead", dead_at=_ago(minutes=21),
                        last_heartbeat=_ago(minutes=22), connected_to="", **version)  # fmt: skip

    make_eviction(dead, minutes_ago=12, in_flight=2, reassigned=2)
    make_eviction(g_dead, minutes_ago=21, in_flight=3, reassigned=0)
    earlier = make_agent(acme, "acme-agent-7", state="dead", dead_at=_ago(hours=5),
                         last_heartbeat=_ago(hours=5), connected_to="", **version)  # fmt: skip
    make_eviction(earlier, minutes_ago=60 * 5, in_flight=1, reassigned=1)

    for minutes, (decision, old, new, util, reason) in {
        2: ("hold", 3, 3, 0.62, "utilization 0.62 between thresholds"),
        9: ("up", 2, 3, 0.91, "utilization 0.91 >= 0.80 with backlog 14"),
        16: ("hold", 2, 2, 0.85, "in cooldown (60s)"),
        25: ("up", 1, 2, 0.97, "utilization 0.97 >= 0.80 with backlog 30"),
    }.items():
        AutoscaleDecision.objects.create(
            tenant=acme, at=_ago(minutes=minutes), decision=decision, old_desired=old,
            new_desired=new, utilization=util, backlog=int(util * 15), reason=reason,
        )  # fmt: skip

    for tenant in (acme, globex):
        publish_example(tenant)
    done, tasks = start(acme, "etl", {"source": "s3://bucket/day=1"})
    finish(tasks["extract"], output={"rows": 1200})
    for name in ("transform_a", "transform_b"):
        finish(tasks_of(done)[name], output={name: "ok"})
    finish(tasks_of(done)["load"], output={"loaded": True})

    running, tasks = start(acme, "etl", {"fail_once": True, "marker_path": "/tmp/m"})
    finish(tasks["extract"], "failure", error_type="RuntimeError",
           error_message="first attempt fails on purpose (fail_once)")  # fmt: skip
    TaskExecution.objects.filter(pk=tasks["extract"].pk).update(ready_at=timezone.now())
    finish(tasks_of(running)["extract"], output={"rows": 800})
    current = tasks_of(running)
    TaskExecution.objects.filter(pk=current["transform_a"].pk).update(
        status="Running", attempt=1, agent=a1, started_at=_ago(seconds=8)
    )
    TaskExecution.objects.filter(pk=current["transform_b"].pk).update(
        status="Running", attempt=1, agent=a2, started_at=_ago(seconds=5)
    )
    # Both packets were first sent to acme-agent-9 and moved when it died.
    for task, agent, age in ((current["transform_a"], a1, 8), (current["transform_b"], a2, 5)):
        row = make_outbox_row(task, agent, "delivered", age_s=age)
        DeliveryOutbox.objects.filter(pk=row.pk).update(former_agents=[str(dead.pk)])

    for n in range(WEDGED_PACKETS):
        _, g_tasks = start(globex, "etl", {"batch": n})
        g_extract = g_tasks["extract"]
        TaskExecution.objects.filter(pk=g_extract.pk).update(
            status="Running", attempt=1, agent=g_dead,
            wait_reason="no live agent of tenant globex: the packet waits for one",
        )  # fmt: skip
        make_outbox_row(g_extract, g_dead, "pending", age_s=(21 - n * 3) * 60)
    for _ in range(3):
        start(globex, "etl", {})  # Ready backlog with no agent

    now = timezone.now()
    samples = []
    for i in range(120):  # every 30 s over the last hour
        at = now - timedelta(seconds=30 * (120 - i))
        minutes_left = (120 - i) / 2
        acme_pending = max(0, round(1.5 + 2 * math.sin(i / 9)))
        acme_delivered = round(3 + 2 * math.sin(i / 14))
        # globex: its only agent died 21 minutes ago; packets pile up and never leave.
        globex_pending = sum(1 for n in range(WEDGED_PACKETS) if minutes_left <= 21 - n * 3)
        samples.append(OutboxDepthSample(tenant=acme, at=at, pending=acme_pending,
                                         delivered=acme_delivered))  # fmt: skip
        samples.append(OutboxDepthSample(tenant=globex, at=at, pending=globex_pending, delivered=0))
        samples.append(OutboxDepthSample(tenant=initech, at=at, pending=0, delivered=0))
    OutboxDepthSample.objects.bulk_create(samples)
    for change, minutes in zip(
        FleetChange.objects.order_by("-id"), (31, 44, 58, 75, 90, 120, 200), strict=False
    ):
        FleetChange.objects.filter(pk=change.pk).update(at=_ago(minutes=minutes))
    assert DeliveryOutbox.objects.count() == 2 + WEDGED_PACKETS and Agent.objects.count() == 8
    return {"execution": running}


def test_screenshots_of_the_main_pages(page, live_server, admin_user, screenshot_dir):
    started = time.time() - 1  # file times may be coarser than the clock
    scene = _build_fleet()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    login(page, live_server, with_password(admin_user).username, PASSWORD)
    pages = dict(PAGES, execution=f"/console/executions/{scene['execution'].pk}/")
    for name, path in pages.items():
        page.goto(f"{live_server.url}{path}")
        page.wait_for_load_state("load")
        page.wait_for_function("window.htmx !== undefined")
        page.screenshot(path=str(screenshot_dir / f"{name}.png"), full_page=True)
    assert errors == []
    # Every page's image was written by this run (docs/screenshots holds other tests' too).
    written = {p.name for p in screenshot_dir.glob("*.png") if p.stat().st_mtime >= started}
    assert written >= {f"{n}.png" for n in pages}, written
