"""Eviction history: filters (tenant, time range), pagination, and the work each eviction moved."""

from __future__ import annotations

import json
from datetime import timedelta

from fleet.models import Eviction
from tests.support.console import HX, make_agent, make_eviction, make_outbox_row
from tests.support.factories import publish_example, start


def _agents_listed(body: str) -> list[str]:
    return [chunk.split('"')[0] for chunk in body.split('data-agent="')[1:]]


def test_it_lists_evictions_newest_first_with_the_work_reassigned(admin_client, tenant):
    old = make_agent(tenant, "old", state="dead")
    new = make_agent(tenant, "new", state="dead")
    make_eviction(old, minutes_ago=30, in_flight=1, reassigned=1)
    make_eviction(new, minutes_ago=2, in_flight=3, reassigned=1, reason="no heartbeat for 45s")
    body = admin_client.get("/console/evictions/").content.decode()
    assert _agents_listed(body) == ["new", "old"]
    row = body[body.index('data-agent="new"') :]
    row = row[: row.index("</tr>")]
    assert ">3<" in row and ">1<" in row  # in flight, reassigned
    assert 'class="num cell-warn"' in row and ">2<" in row  # two still waiting for an agent
    assert "no heartbeat for 45s" in row and "45" in row


def test_it_names_the_tasks_moved_to_a_survivor(admin_client, tenant):
    publish_example(tenant)
    _, tasks = start(tenant, "etl", {})
    dead = make_agent(tenant, "dead-1", state="dead")
    survivor = make_agent(tenant, "survivor")
    row = make_outbox_row(tasks["extract"], survivor)
    row.former_agents = [str(dead.pk)]
    row.save()
    make_eviction(dead, in_flight=1, reassigned=1)
    body = admin_client.get("/console/evictions/partials/table/").content.decode()
    assert "extract</a> → survivor" in body


def test_it_filters_by_tenant(admin_client, tenant, other_tenant):
    make_eviction(make_agent(tenant, "a-acme", state="dead"))
    make_eviction(make_agent(other_tenant, "a-globex", state="dead"))
    body = admin_client.get("/console/evictions/?tenant=globex").content.decode()
    assert _agents_listed(body) == ["a-globex"]


def test_a_member_sees_only_its_tenants_evictions(writer_client, tenant, other_tenant):
    make_eviction(make_agent(tenant, "a-acme", state="dead"))
    make_eviction(make_agent(other_tenant, "a-globex", state="dead"))
    body = writer_client.get("/console/evictions/partials/table/").content.decode()
    assert _agents_listed(body) == ["a-acme"]
    assert writer_client.get("/console/evictions/?tenant=globex").status_code == 404


def test_it_filters_by_time_range(admin_client, tenant):
    agent = make_agent(tenant, "a", state="dead")
    for minutes in (5, 120, 60 * 24 * 3):
        e = make_eviction(agent, minutes_ago=minutes)
        e.agent_name = f"m{minutes}"
        e.save()
    listed = lambda q: _agents_listed(admin_client.get(f"/console/evictions/{q}").content.decode())  # noqa: E731
    assert listed("?range=1h") == ["m5"]
    assert listed("") == ["m5", "m120"]  # default: the last 24 hours
    assert listed("?range=7d") == ["m5", "m120", "m4320"]
    assert listed("?range=all") == ["m5", "m120", "m4320"]
    # Explicit bounds (UTC, no offset) win over the preset range.
    e120 = Eviction.objects.get(agent_name="m120").evicted_at
    since = (e120.replace(tzinfo=None) - timedelta(minutes=1)).isoformat()
    until = (e120.replace(tzinfo=None) + timedelta(minutes=1)).isoformat()
    assert listed(f"?range=1h&since={since}&until={until}") == ["m120"]


def test_bad_filters_are_refused_with_the_parameter_named(admin_client, tenant):
    for query, detail in (
        (
            "?since=yesterday",
            "since must be a date and time like 2026-01-31T23:00, got 'yesterday'",
        ),
        ("?since=2026-02-01T00:00&until=2026-01-01T00:00", "since must not be after until"),
        ("?range=2h", "range must be one of 15m, 1h, 6h, 24h, 7d, 30d, all, got '2h'"),
        ("?page=zero", "page must be a whole number ≥ 1, got 'zero'"),
    ):
        response = admin_client.get(f"/console/evictions/partials/table/{query}", **HX)
        assert response.status_code == 400, query
        assert json.loads(response.content)["detail"] == detail
    page = admin_client.get("/console/evictions/?since=yesterday")
    assert page.status_code == 400 and b"got &#x27;yesterday&#x27;" in page.content


def test_it_paginates(admin_client, tenant):
    agent = make_agent(tenant, "a", state="dead")
    for i in range(30):
        e = make_eviction(agent, minutes_ago=i + 1)
        e.agent_name = f"e{i:02d}"
        e.save()
    first = admin_client.get("/console/evictions/").content.decode()
    second = admin_client.get("/console/evictions/?page=2").content.decode()
    assert _agents_listed(first) == [f"e{i:02d}" for i in range(25)]
    assert _agents_listed(second) == [f"e{i:02d}" for i in range(25, 30)]
    assert "page 1 of 2" in first and "?page=2" in first
    assert "30 evictions" in first
    # The polled partial keeps the page it is on.
    assert "/console/evictions/partials/table/?page=2" in second


def test_the_partial_polls(reader_client, tenant):
    body = reader_client.get("/console/evictions/partials/table/?range=1h").content.decode()
    assert body.lstrip().startswith('<section id="evictions"')
    assert 'hx-trigger="every 2s"' in body and "range=1h" in body


def test_moved_work_belongs_to_the_agents_latest_eviction(admin_client, tenant):
    publish_example(tenant)
    _, tasks = start(tenant, "etl", {})
    dead = make_agent(tenant, "dead-1", state="dead")
    row = make_outbox_row(tasks["extract"], make_agent(tenant, "survivor"))
    row.former_agents = [str(dead.pk)]
    row.save()
    make_eviction(dead, minutes_ago=30, reason="first")
    make_eviction(dead, minutes_ago=1, reason="latest")
    body = admin_client.get("/console/evictions/").content.decode()
    assert body.count("extract</a> → survivor") == 1
    assert body.index("extract</a> → survivor") < body.index("first")
