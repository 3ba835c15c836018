"""Outbox depth per tenant and state, the oldest pending age, and the SVG depth chart.

Here: the integration tests (database, in-process ASGI, fakes); the rest are in tests/unit/test_console_outbox.py.
"""

from __future__ import annotations

import math
import re
import time
from datetime import timedelta

from django.utils import timezone

from fleet.models import OutboxDepthSample
from tests.support.console import make_agent, make_outbox_row
from tests.support.factories import publish_example, start


def _tasks(tenant):
    publish_example(tenant)
    return start(tenant, "etl", {})[1]


def _row(body: str, tenant_name: str) -> str:
    at = body.index(f'data-tenant="{tenant_name}"')
    return body[body.rindex("<tr", 0, at) : body.index("</tr>", at)]


def test_it_shows_depth_per_state_and_the_oldest_pending_age(admin_client, tenant):
    tasks = _tasks(tenant)
    agent = make_agent(tenant, "a1")
    began = time.monotonic()
    make_outbox_row(tasks["extract"], agent, "pending", age_s=12)
    make_outbox_row(tasks["transform_a"], agent, "pending", age_s=3)
    make_outbox_row(tasks["transform_b"], agent, "delivered", age_s=4)
    make_outbox_row(tasks["load"], agent, "acked", age_s=50)
    body = admin_client.get("/console/outbox/").content.decode()
    row = _row(body, "acme")
    assert 'id="pending-acme">2<' in row and 'id="delivered-acme">1<' in row
    assert ">1<" in row  # acked
    # Oldest pending: the 12-second-old packet, older by the time the page took to render
    # (a loaded machine rendered it a second late: 13 s).
    ages = [int(age) for age in re.findall(r">(\d+)s<", row)]
    late = math.ceil(time.monotonic() - began)
    assert any(12 <= age <= 12 + late for age in ages), (ages, late)
    assert "wedged" not in row
    assert "Oldest open packets" in body and "extract</a>" in body


def test_it_calls_an_old_pending_packet_wedged(admin_client, tenant, other_tenant):
    tasks = _tasks(tenant)
    make_outbox_row(tasks["extract"], make_agent(tenant, "a1"), age_s=300)
    body = admin_client.get("/console/outbox/partials/depth/").content.decode()
    row = _row(body, "acme")
    assert "level-bad" in row and "wedged" in row and "cell-bad" in row
    assert body.index('data-tenant="acme"') < body.index('data-tenant="globex"')


def test_it_draws_depth_over_time_from_samples_plus_the_live_depth(admin_client, tenant):
    now = timezone.now()
    for minutes, pending in (
        (50, 0),
        (40, 7),
        (30, 3),
        (90, 99),
    ):  # the 90-minute one is out of range
        OutboxDepthSample.objects.create(
            tenant=tenant, at=now - timedelta(minutes=minutes), pending=pending, delivered=1
        )
    tasks = _tasks(tenant)
    make_outbox_row(tasks["extract"], make_agent(tenant, "a1"))
    body = admin_client.get("/console/outbox/partials/depth/?tenant=acme").content.decode()
    chart = body[body.index('<figure class="chart" data-tenant="acme"') :]
    chart = chart[: chart.index("</figure>")]
    pending_line = chart.split('class="line-pending" points="')[1].split('"')[0]
    assert len(pending_line.split()) == 4  # three samples in the hour, then the live depth
    assert 'data-pending-now="1"' in chart
    assert "peak 7 in this range" in chart
    wide = admin_client.get("/console/outbox/partials/depth/?tenant=acme&range=6h").content
    assert b"peak 99 in this range" in wide


def test_a_member_sees_only_its_tenants_outbox(writer_client, tenant, other_tenant):
    body = writer_client.get("/console/outbox/").content.decode()
    assert 'data-tenant="acme"' in body and "globex" not in body
    assert writer_client.get("/console/outbox/partials/depth/?tenant=globex").status_code == 404


def test_the_partial_polls(reader_client, tenant):
    body = reader_client.get("/console/outbox/partials/depth/").content.decode()
    assert body.lstrip().startswith('<section id="outbox"')
    assert 'hx-trigger="every 2s"' in body
