"""The fleet overview: one live row per visible tenant, trouble first, numbers right."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from fleet.console.fleet_rows import BAD, WARN, tenant_rows
from tests.support.console import HX, make_agent, make_eviction, make_outbox_row
from tests.support.factories import publish_example, start


def _row_html(body: str, tenant_name: str) -> str:
    start_at = body.index(f'id="tenant-row-{tenant_name}"')
    return body[start_at : body.index("</tr>", start_at)]


def test_it_shows_a_member_only_its_tenants(writer_client, tenant, other_tenant):
    body = writer_client.get("/console/").content.decode()
    assert 'id="tenant-row-acme"' in body
    assert "globex" not in body


def test_it_shows_a_platform_admin_every_tenant(admin_client, tenant, other_tenant):
    body = admin_client.get("/console/").content.decode()
    assert 'id="tenant-row-acme"' in body and 'id="tenant-row-globex"' in body


def test_it_shows_the_fleet_numbers(admin_client, tenant):
    from fleet.models import AutoscaleDecision

    tenant.max_agents_override = 6
    tenant.desired_count = 3
    tenant.save()
    make_agent(tenant, "a1", in_flight=3, max_concurrency=4)
    make_agent(tenant, "a2", in_flight=1, max_concurrency=4)
    make_agent(tenant, "gone", state="dead", dead_at=timezone.now())
    dead = make_agent(tenant, "old", state="dead", dead_at=timezone.now())
    make_eviction(dead, minutes_ago=5)
    make_eviction(dead, minutes_ago=90)  # outside the hour
    AutoscaleDecision.objects.create(
        tenant=tenant, utilization=0.5, decision="up", old_desired=2, new_desired=3,
        reason="utilization 0.91 >= 0.8", at=timezone.now() - timedelta(minutes=3),
    )  # fmt: skip
    AutoscaleDecision.objects.create(
        tenant=tenant, decision="hold", old_desired=3, new_desired=3, reason="in cooldown"
    )
    publish_example(tenant)
    _, tasks = start(tenant, "etl", {})
    make_outbox_row(tasks["extract"], dead, age_s=5)

    row = _row_html(admin_client.get("/console/partials/overview/").content.decode(), "acme")
    assert 'id="desired-acme">3<' in row
    assert '6 <span class="badge"' in row  # limit 6, overridden
    assert "2 / 2" in row  # live / total: the dead agents are not counted
    assert "50%" in row  # 4 in flight of 8 slots
    assert 'id="outbox-acme">1 ' in row
    assert "in cooldown" in row and "utilization 0.91" not in row  # the latest decision only
    assert ">1</a>" in row  # one eviction in the last hour, linked to the filtered history
    assert "range=1h" in row


def test_it_puts_tenants_in_trouble_first_and_says_why(admin_client, tenant, other_tenant):
    other_tenant.desired_count = 2
    other_tenant.save()
    body = admin_client.get("/console/").content.decode()
    assert body.index("tenant-row-globex") < body.index("tenant-row-acme")
    assert "2 of 2 desired agent(s) missing" in _row_html(body, "globex")
    assert "1 of 2 tenants needs attention" in body
    assert 'class="level-bad"' in body


def test_it_flags_a_wedged_outbox(tenant):
    publish_example(tenant)
    _, tasks = start(tenant, "etl", {})
    agent = make_agent(tenant, "a1")
    make_outbox_row(tasks["extract"], agent, age_s=600)
    [row] = tenant_rows([tenant], None)
    assert row.severity == BAD
    assert any("outbox wedged" in p.text for p in row.problems)


def test_it_warns_about_recent_evictions(tenant):
    agent = make_agent(tenant, "a1", state="dead")
    make_eviction(agent, minutes_ago=10)
    [row] = tenant_rows([tenant], None)
    assert row.severity == WARN
    assert [p.text for p in row.problems] == ["1 eviction(s) in the last hour"]


def test_a_healthy_fleet_has_no_problems(admin_client, tenant):
    tenant.desired_count = 1
    tenant.save()
    make_agent(tenant, "a1")
    [row] = tenant_rows([tenant], None)
    assert row.problems == []
    assert b"All 1 tenant healthy" in admin_client.get("/console/").content


def test_the_partial_is_the_polled_table_alone(writer_client, tenant):
    body = writer_client.get("/console/partials/overview/", **HX).content.decode()
    assert body.lstrip().startswith('<section id="overview"')
    assert 'hx-trigger="every 2s, fleet-changed from:body"' in body
    assert "<html" not in body


def test_a_writer_gets_live_buttons(writer_client, tenant):
    row = _row_html(writer_client.get("/console/").content.decode(), "acme")
    assert 'title="desired_count + 1"' in row
    assert 'disabled title="desired_count is already 0"' in row  # −1 at the lower bound


def test_a_reader_gets_disabled_buttons_with_the_reason(reader_client, tenant):
    row = _row_html(reader_client.get("/console/").content.decode(), "acme")
    assert row.count('disabled title="your role in acme is read-only"') == 2


def test_the_provision_button_is_disabled_at_the_limit(writer_client, tenant):
    tenant.max_agents_override = 2
    tenant.desired_count = 2
    tenant.save()
    row = _row_html(writer_client.get("/console/").content.decode(), "acme")
    assert 'disabled title="at the effective limit of 2 agents"' in row
    assert "at limit 2" in row


@pytest.mark.django_db
def test_the_overview_query_count_does_not_grow_per_agent(
    admin_client, tenant, django_assert_max_num_queries
):
    for i in range(20):
        make_agent(tenant, f"a{i}")
    with django_assert_max_num_queries(15):
        admin_client.get("/console/partials/overview/")


def _config(monkeypatch, **changes):
    from dataclasses import replace

    from fleet.console import fleet_rows
    from fleet.platform.config import get_config

    config = replace(get_config(), **changes)
    monkeypatch.setattr(fleet_rows, "get_config", lambda: config)


def test_on_the_fleet_a_backlog_without_live_agents_is_red(tenant, monkeypatch):
    publish_example(tenant)
    start(tenant, "etl", {})
    _config(monkeypatch, default_executor="fleet")
    [row] = tenant_rows([tenant], None)
    assert [p.text for p in row.problems] == ["1 task(s) waiting and no live agent"]
    assert row.severity == BAD
    # In-process execution needs no agent: the same backlog is no problem there.
    _config(monkeypatch, default_executor="default")
    assert tenant_rows([tenant], None)[0].problems == []


def test_busy_at_the_limit_asks_for_a_platform_admin(tenant):
    tenant.max_agents_override = 1
    tenant.desired_count = 1
    tenant.save()
    make_agent(tenant, "a1", in_flight=4, max_concurrency=4)
    [row] = tenant_rows([tenant], None)
    assert [p.text for p in row.problems] == ["busy (100%) and at the limit of 1"]
    assert row.severity == WARN
