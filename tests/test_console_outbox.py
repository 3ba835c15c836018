"""Outbox depth per tenant and state, the oldest pending age, and the SVG depth chart."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.utils import timezone

from fleet.console.charts import DepthPoint, depth_chart_svg, downsample, nice_ceiling
from fleet.models import OutboxDepthSample
from tests.console_fixtures import *  # noqa: F403
from tests.console_fixtures import make_agent, make_outbox_row
from tests.factories import publish_example, start


def _tasks(tenant):
    publish_example(tenant)
    return start(tenant, "etl", {})[1]


def _row(body: str, tenant_name: str) -> str:
    at = body.index(f'data-tenant="{tenant_name}"')
    return body[body.rindex("<tr", 0, at) : body.index("</tr>", at)]


def test_it_shows_depth_per_state_and_the_oldest_pending_age(admin_client, tenant):
    tasks = _tasks(tenant)
    agent = make_agent(tenant, "a1")
    make_outbox_row(tasks["extract"], agent, "pending", age_s=12)
    make_outbox_row(tasks["transform_a"], agent, "pending", age_s=3)
    make_outbox_row(tasks["transform_b"], agent, "delivered", age_s=4)
    make_outbox_row(tasks["load"], agent, "acked", age_s=50)
    body = admin_client.get("/console/outbox/").content.decode()
    row = _row(body, "acme")
    assert 'id="pending-acme">2<' in row and 'id="delivered-acme">1<' in row
    assert ">1<" in row  # acked
    assert ">12s<" in row  # oldest pending
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


def _at(minute: int) -> datetime:
    return datetime(2026, 1, 1, 12, 0, tzinfo=UTC) + timedelta(minutes=minute)


def test_the_chart_scales_to_a_readable_ceiling():
    assert [nice_ceiling(v) for v in (0, 1, 3, 7, 12, 180, 501)] == [1, 1, 5, 10, 20, 200, 1000]
    svg = depth_chart_svg(
        [DepthPoint(_at(0), 0, 0), DepthPoint(_at(30), 7, 2), DepthPoint(_at(60), 0, 0)],
        _at(0),
        _at(60),
        "acme",
    )
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert ">10</text>" in svg and ">5</text>" in svg  # y axis 0..10
    assert ">12:00</text>" in svg and ">13:00</text>" in svg
    # The peak sits at 70% of the plot height from the bottom.
    pending = svg.split('class="line-pending" points="')[1].split('"')[0].split()
    ys = [float(p.split(",")[1]) for p in pending]
    assert ys[0] == ys[2] and ys[1] < ys[0]


def test_the_chart_says_when_it_has_nothing_and_escapes_labels():
    svg = depth_chart_svg([], _at(0), _at(60), "<script>")
    assert "no samples in this range" in svg
    assert "<script>" not in svg and "&lt;script&gt;" in svg


def test_downsampling_keeps_every_spike():
    points = [DepthPoint(_at(0) + timedelta(seconds=i), 0, 0) for i in range(5000)]
    points[3333] = DepthPoint(points[3333].at, 42, 0)
    small = downsample(points, 100)
    assert len(small) <= 100
    assert max(p.pending for p in small) == 42
