"""Console, admin and API docs in real Chromium under the Content-Security-Policy.

Every page must still work — htmx live updates and actions, Swagger UI, the admin —
with the browser reporting no policy violation and fetching nothing from another
origin (the docs once loaded Swagger UI from a public CDN).
"""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from playwright.sync_api import expect

from cloacina_site.web_security import CONTENT_SECURITY_POLICY
from tests.support.browser import login
from tests.support.console import PASSWORD, with_password

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

RECORD_VIOLATIONS = """
window.__csp = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.__csp.push(e.violatedDirective + " " + (e.blockedURI || "inline"));
});
"""


@pytest.fixture
def watched(page, live_server):
    """The page, recording CSP violations (DOM events and console) and foreign requests."""
    page.add_init_script(RECORD_VIOLATIONS)
    console: list[str] = []
    foreign: list[str] = []
    origin = urlsplit(live_server.url).netloc
    page.on(
        "console",
        lambda m: console.append(m.text) if "Content Security Policy" in m.text else None,
    )
    page.on(
        "request",
        lambda r: (
            foreign.append(r.url)
            if r.url.startswith("http") and urlsplit(r.url).netloc != origin
            else None
        ),
    )
    page.watched = (console, foreign)
    return page


def _clean(page) -> None:
    console, foreign = page.watched
    violations = page.evaluate("window.__csp")
    assert not violations and not console, (violations, console)
    assert not foreign, foreign


def _goto(page, url: str) -> None:
    response = page.goto(url)
    assert response.status == 200, url
    assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY


def test_the_console_works_under_the_policy(watched, live_server, admin_user, tenant):
    page = watched
    _goto(page, f"{live_server.url}/console/login/")
    login(page, live_server, with_password(admin_user).username, PASSWORD)
    desired = page.locator("#desired-acme")
    expect(desired).to_have_text("0")
    page.locator("#tenant-row-acme button[name=provision]").click()  # an htmx POST
    expect(desired).to_have_text("1", timeout=5000)  # and the live partial it refreshes
    expect(page.locator("#flash")).to_contain_text("desired_count 0 → 1")
    for path in (
        "executions/",
        "evictions/",
        "outbox/",
        "tenants/acme/",
        "tenants/acme/schedules/",
    ):
        _goto(page, f"{live_server.url}/console/{path}")
    page.wait_for_timeout(1200)  # a couple of live polls on the last page
    _clean(page)


def test_the_schedules_page_pauses_and_runs_under_the_policy(
    watched, live_server, admin_user, tenant
):
    from fleet.models import ScheduleFire
    from fleet.schedules.service import ScheduleSpec, create_schedule
    from tests.support.factories import make_package

    make_package(
        tenant, [{"id": "a", "function": "demo.steps:a"}], "def a(context):\n    return None\n"
    )
    schedule = create_schedule(tenant, ScheduleSpec("demo", "0 6 * * *", timezone="Asia/Tokyo"))
    page = watched
    _goto(page, f"{live_server.url}/console/login/")
    login(page, live_server, with_password(admin_user).username, PASSWORD)
    _goto(page, f"{live_server.url}/console/tenants/acme/schedules/")
    expect(page.locator("#schedules")).to_contain_text("06:00:00 JST")
    page.get_by_role("button", name=f"run schedule {str(schedule.pk)[:8]} now").click()
    expect(page.locator("#flash")).to_contain_text("manual run")
    expect(page.locator("#schedules")).to_contain_text("manual", timeout=5000)
    page.get_by_role("button", name=f"pause schedule {str(schedule.pk)[:8]}").click()
    expect(page.locator("#schedules")).to_contain_text("paused", timeout=5000)
    assert ScheduleFire.objects.filter(schedule=schedule, outcome="manual").count() == 1
    _clean(page)


def test_swagger_ui_renders_from_this_server_under_the_policy(watched, live_server):
    page = watched
    _goto(page, f"{live_server.url}/api/v1/docs")
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("Cloacina", timeout=10_000)
    expect(page.locator(".opblock").first).to_be_visible()  # the operations were fetched
    _clean(page)


def test_the_admin_works_under_the_policy(watched, live_server, admin_user):
    page = watched
    _goto(page, f"{live_server.url}/admin/login/")
    page.fill("input[name=username]", with_password(admin_user).username)
    page.fill("input[name=password]", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url(f"{live_server.url}/admin/")
    _goto(page, f"{live_server.url}/admin/auth/user/")
    expect(page.locator("#result_list")).to_be_visible()
    _clean(page)
