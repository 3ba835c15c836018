"""The console in real headless Chromium against a live server: what an operator does at night.

Log in, scale a tenant from the overview and see desired_count change without
a reload; let an agent die (the real liveness sweep) and see the eviction and
the moved work appear; see outbox depth move as packets are queued and acked;
see refused actions and failing live updates reported on the page.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from fleet.models import DeliveryOutbox, FleetChange
from tests.support.browser import login
from tests.support.console import PASSWORD, make_agent, make_outbox_row, with_password
from tests.support.factories import publish_example, start

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

LIVE_UPDATE_S = 5  # partials poll every 0.5 s here (fast_polling); allow for a busy machine


def _no_reload_marker(page) -> None:
    page.evaluate("window.__stillTheSamePage = true")


def _assert_not_reloaded(page) -> None:
    assert page.evaluate("window.__stillTheSamePage === true"), "the page was reloaded"


def test_provision_from_the_overview_updates_without_a_reload(
    page, live_server, writer_user, tenant
):
    tenant.max_agents_override = 2
    tenant.save()
    login(page, live_server, with_password(writer_user).username, PASSWORD)
    desired = page.locator("#desired-acme")
    expect(desired).to_have_text("0")
    _no_reload_marker(page)

    page.locator("#tenant-row-acme button[name=provision]").click()
    expect(desired).to_have_text("1", timeout=LIVE_UPDATE_S * 1000)
    expect(page.locator("#flash")).to_contain_text("acme: desired_count 0 → 1")
    page.locator("#tenant-row-acme button[name=provision]").click()
    expect(desired).to_have_text("2", timeout=LIVE_UPDATE_S * 1000)
    # At the limit the button is disabled and says why.
    plus = page.locator("#tenant-row-acme button[name=provision]")
    expect(plus).to_be_disabled()
    expect(plus).to_have_attribute("title", "at the effective limit of 2 agents")
    _assert_not_reloaded(page)
    assert list(FleetChange.objects.values_list("new_value", "actor").order_by("id")) == [
        (1, "console:wendy"),
        (2, "console:wendy"),
    ]


def test_a_reason_typed_on_the_tenant_page_survives_polling_and_is_audited(
    page, live_server, writer_user, tenant
):
    login(page, live_server, with_password(writer_user).username, PASSWORD)
    page.goto(f"{live_server.url}/console/tenants/acme/")
    _no_reload_marker(page)
    reason = page.locator("#scale-reason-acme")
    reason.fill("load test at 9")
    # Several polls of the fleet card go by (0.5 s here); the text being typed stays.
    with page.expect_response(lambda r: "/partials/fleet/" in r.url):
        pass
    with page.expect_response(lambda r: "/partials/fleet/" in r.url):
        pass
    expect(reason).to_have_value("load test at 9")
    reason.press("Enter")  # the form's default button is disabled: Enter never scales
    page.locator("#tenant-fleet button[name=provision]").click()
    expect(page.locator("#flash")).to_contain_text("acme: desired_count 0 → 1")
    expect(page.locator("#tenant-changes")).to_contain_text(
        "manual: load test at 9", timeout=LIVE_UPDATE_S * 1000
    )
    _assert_not_reloaded(page)
    assert list(FleetChange.objects.values_list("new_value", "actor", "note")) == [
        (1, "console:wendy", "load test at 9")
    ]


def test_a_change_made_elsewhere_shows_up_live(page, live_server, admin_user, tenant):
    login(page, live_server, with_password(admin_user).username, PASSWORD)
    _no_reload_marker(page)
    from fleet.control import limits

    limits.set_fleet_overrides(tenant, "test", desired_count=3)
    expect(page.locator("#desired-acme")).to_have_text("3", timeout=LIVE_UPDATE_S * 1000)
    _assert_not_reloaded(page)


def test_a_dead_agent_appears_in_the_eviction_history(page, live_server, admin_user, tenant):
    from fleet.executors.fleet.lifecycle import sweep_dead_agents

    publish_example(tenant)
    _, tasks = start(tenant, "etl", {})
    doomed = make_agent(tenant, "doomed-1", in_flight=1)
    make_agent(tenant, "survivor-1")
    make_outbox_row(tasks["extract"], doomed, "delivered")
    from fleet.models import TaskExecution

    TaskExecution.objects.filter(pk=tasks["extract"].pk).update(
        status="Running", assignment=1, agent=doomed, attempt=1
    )
    login(page, live_server, with_password(admin_user).username, PASSWORD)
    page.goto(f"{live_server.url}/console/evictions/")
    expect(page.locator("#evictions")).to_contain_text("No evictions in this range")
    _no_reload_marker(page)

    # The agent stops beating; the real liveness sweep declares it dead and moves its work.
    from agents.models import Agent

    Agent.objects.filter(pk=doomed.pk).update(last_heartbeat=timezone.now() - timedelta(hours=1))
    [eviction] = sweep_dead_agents()
    assert eviction.reassigned == 0 and DeliveryOutbox.objects.get().agent.name == "survivor-1"

    row = page.locator('#evictions tr[data-agent="doomed-1"]')
    expect(row).to_be_visible(timeout=LIVE_UPDATE_S * 1000)
    expect(row).to_contain_text("extract → survivor-1")
    expect(row).to_contain_text("no heartbeat for")
    _assert_not_reloaded(page)

    page.goto(f"{live_server.url}/console/tenants/acme/")
    expect(page.locator('tr[data-agent="doomed-1"]')).to_contain_text("dead")
    expect(page.locator("#tenant-fleet")).to_contain_text("1 eviction(s) in the last hour")


def test_outbox_depth_moves_live(page, live_server, admin_user, tenant):
    from fleet.executors.fleet.delivery.depth import sample_outbox_depth

    publish_example(tenant)
    _, tasks = start(tenant, "etl", {})
    agent = make_agent(tenant, "a1")
    login(page, live_server, with_password(admin_user).username, PASSWORD)
    page.goto(f"{live_server.url}/console/outbox/")
    pending = page.locator("#pending-acme")
    expect(pending).to_have_text("0")
    _no_reload_marker(page)

    for name in ("extract", "transform_a", "transform_b"):
        make_outbox_row(tasks[name], agent, "pending")
    sample_outbox_depth()
    expect(pending).to_have_text("3", timeout=LIVE_UPDATE_S * 1000)
    chart = page.locator('figure.chart[data-tenant="acme"] svg')
    expect(chart).to_have_attribute("data-pending-now", "3")

    DeliveryOutbox.objects.filter(task_execution=tasks["extract"]).update(state="delivered")
    DeliveryOutbox.objects.exclude(task_execution=tasks["extract"]).update(state="acked")
    expect(pending).to_have_text("0", timeout=LIVE_UPDATE_S * 1000)
    expect(page.locator("#delivered-acme")).to_have_text("1")
    _assert_not_reloaded(page)
    # The overview shows the same depth.
    page.goto(f"{live_server.url}/console/")
    expect(page.locator("#outbox-acme")).to_contain_text("1")


def test_a_refused_action_is_reported_on_the_page(page, live_server, reader_user, tenant):
    login(page, live_server, with_password(reader_user).username, PASSWORD)
    expect(page.locator("#tenant-row-acme button[name=provision]")).to_be_disabled()
    # Hiding the button is not the check: the server refuses the POST itself.
    page.evaluate(
        "htmx.ajax('POST', '/console/tenants/acme/provision/', {source: document.body, swap: 'none'})"
    )
    expect(page.locator("#flash")).to_contain_text("403: your role in tenant 'acme' is read-only")
    tenant.refresh_from_db()
    assert tenant.desired_count == 0


def test_failing_live_updates_raise_a_banner(page, live_server, reader_user, tenant):
    login(page, live_server, with_password(reader_user).username, PASSWORD)
    banner = page.locator("#stale-banner")
    expect(banner).to_be_hidden()
    page.route("**/console/partials/**", lambda route: route.abort())
    expect(banner).to_be_visible(timeout=LIVE_UPDATE_S * 1000)
    page.unroute("**/console/partials/**")
    expect(banner).to_be_hidden(timeout=LIVE_UPDATE_S * 1000)


def test_an_action_answer_is_shown_when_a_poll_replaced_its_form_meanwhile(
    page, live_server, admin_user, tenant
):
    """The schedules table polls; a "Run now" whose answer arrives after a refresh replaced
    the table (and the form in it) must still flash its message and refresh the table."""
    from fleet.models import ScheduleFire
    from fleet.schedules.service import ScheduleSpec, create_schedule
    from tests.support.factories import make_package

    make_package(
        tenant, [{"id": "a", "function": "demo.steps:a"}], "def a(context):\n    return None\n"
    )
    schedule = create_schedule(tenant, ScheduleSpec("demo", "0 6 * * *"))
    login(page, live_server, with_password(admin_user).username, PASSWORD)
    page.goto(f"{live_server.url}/console/tenants/acme/schedules/")
    expect(page.locator("#schedules")).to_contain_text("never fired")
    held = []
    page.route(f"**/schedules/{schedule.pk}/run/", lambda route: held.append(route))  # late
    page.get_by_role("button", name=f"run schedule {str(schedule.pk)[:8]} now").click()
    deadline = timezone.now() + timedelta(seconds=LIVE_UPDATE_S)
    while not held and timezone.now() < deadline:
        page.wait_for_timeout(50)
    assert held, "the run request never left the page"
    page.evaluate("window.__oldTable = document.getElementById('schedules')")
    with page.expect_response(lambda r: "/schedules/partials/table/" in r.url):
        page.evaluate("document.body.dispatchEvent(new Event('fleet-changed'))")
    page.wait_for_function("document.getElementById('schedules') !== window.__oldTable")
    held[0].continue_()
    expect(page.locator("#flash")).to_contain_text("manual run", timeout=LIVE_UPDATE_S * 1000)
    expect(page.locator("#schedules")).to_contain_text("manual", timeout=LIVE_UPDATE_S * 1000)
    assert ScheduleFire.objects.filter(schedule=schedule, outcome="manual").count() == 1
