"""The tenant page: roster, provision/deprovision through the control plane, admin overrides."""

from __future__ import annotations

import json
from datetime import timedelta

from django.utils import timezone

from fleet.models import AutoscaleDecision, FleetChange
from tests.support.console import HX, make_agent


def _changes(tenant):
    return list(
        FleetChange.objects.filter(tenant=tenant)
        .order_by("id")
        .values_list("field", "old_value", "new_value", "reason", "actor")
    )


def _agent_row(body: str, name: str) -> str:
    at = body.index(f'data-agent="{name}"')
    start = body.rindex("<tr", 0, at)
    return body[start : body.index("</tr>", at)]


def test_it_lists_the_agent_roster(reader_client, tenant):
    now = timezone.now()
    make_agent(tenant, "fresh", version="0.3.1", in_flight=2, max_concurrency=8)
    make_agent(tenant, "draining-one", state="draining")
    make_agent(tenant, "late", last_heartbeat=now - timedelta(seconds=30))
    make_agent(tenant, "silent", last_heartbeat=now - timedelta(seconds=600))
    make_agent(tenant, "died", state="dead", dead_at=now - timedelta(minutes=5))
    make_agent(tenant, "long-dead", state="dead", dead_at=now - timedelta(hours=3))
    body = reader_client.get("/console/tenants/acme/partials/agents/").content.decode()
    names = [line.split('data-agent="')[1].split('"')[0] for line in body.split("<tr")[2:]]
    assert names == ["fresh", "late", "silent", "draining-one", "died"]  # live, draining, dead
    fresh = _agent_row(body, "fresh")
    assert "0.3.1" in fresh and "x86_64-unknown-linux-gnu" in fresh and ">8<" in fresh
    assert "level" not in fresh
    silent = _agent_row(body, "silent")
    assert "level-bad" in silent and "over the 45s window" in silent
    assert "level-warn" in _agent_row(body, "late")
    assert "long-dead" not in body


def test_the_roster_shows_each_agents_phase_and_circuit_breaker(reader_client, tenant):
    now = timezone.now()
    make_agent(tenant, "idle")
    make_agent(tenant, "full", in_flight=2, max_concurrency=2)
    make_agent(tenant, "lost", connected_to="", connection_generation=2)
    make_agent(tenant, "new", connected_to="")
    make_agent(tenant, "tripped", breaker_open_until=now + timedelta(seconds=30))
    make_agent(tenant, "probing", breaker_open_until=now - timedelta(seconds=1))
    make_agent(tenant, "left", state="stopped", dead_at=now - timedelta(minutes=1))
    body = reader_client.get("/console/tenants/acme/partials/agents/").content.decode()
    expected = {
        "idle": ("ready", "closed"), "full": ("busy", "closed"), "lost": ("disconnected", "closed"),
        "new": ("connecting", "closed"), "tripped": ("ready", "open"),
        "probing": ("ready", "half_open"), "left": ("stopped", "closed"),
    }  # fmt: skip
    for name, (phase, breaker) in expected.items():
        row = _agent_row(body, name)
        assert f'data-phase="{phase}"' in row and f'data-breaker="{breaker}"' in row, name
    assert "no new work until" in _agent_row(body, "tripped")
    assert 'class="state state-stopped"' in _agent_row(body, "left")


def test_the_page_shows_fleet_card_decisions_and_audit(reader_client, tenant):
    AutoscaleDecision.objects.create(
        tenant=tenant, utilization=0.93, backlog=7, decision="up", old_desired=1, new_desired=2,
        reason="utilization 0.93 >= 0.80",
    )  # fmt: skip
    FleetChange.objects.create(
        tenant=tenant, field="desired_count", old_value=1, new_value=2, reason="autoscaler",
        actor="autoscaler",
    )  # fmt: skip
    body = reader_client.get("/console/tenants/acme/").content.decode()
    assert 'id="tenant-fleet"' in body and 'id="desired-acme">0<' in body
    assert "93%" in body and "utilization 0.93 &gt;= 0.80" in body
    assert "1 → 2" in body and "autoscaler" in body
    assert "Platform overrides" not in body  # only for platform admins
    assert "read-only" in body


def test_each_partial_renders_alone_and_polls(reader_client, tenant):
    for part in ("fleet", "agents", "decisions", "changes"):
        body = reader_client.get(f"/console/tenants/acme/partials/{part}/").content.decode()
        assert body.lstrip().startswith("<section"), part
        assert 'hx-trigger="every 2s' in body, part
        assert "<html" not in body
    assert reader_client.get("/console/tenants/acme/partials/nope/").status_code == 404


def test_a_writer_provisions_with_htmx(writer_client, tenant):
    response = writer_client.post("/console/tenants/acme/provision/", **HX)
    assert response.status_code == 204
    trigger = json.loads(response["HX-Trigger"])
    assert trigger["fleet-changed"] is True
    assert trigger["console-flash"]["message"] == "acme: desired_count 0 → 1"
    tenant.refresh_from_db()
    assert tenant.desired_count == 1
    assert _changes(tenant) == [("desired_count", 0, 1, "manual", "console:wendy")]


def test_a_plain_form_post_redirects_back_with_a_message(writer_client, tenant):
    response = writer_client.post("/console/tenants/acme/provision/", {"next": "/console/"})
    assert response.status_code == 302 and response["Location"] == "/console/"
    page = writer_client.get(response["Location"]).content.decode()
    assert "acme: desired_count 0 → 1" in page
    # An outside URL in next is not followed.
    response = writer_client.post(
        "/console/tenants/acme/provision/", {"next": "https://evil.example/"}
    )
    assert response["Location"] == "/console/tenants/acme/"


def test_provision_at_the_limit_is_refused_and_changes_nothing(writer_client, tenant):
    tenant.max_agents_override = 1
    tenant.desired_count = 1
    tenant.save()
    response = writer_client.post("/console/tenants/acme/provision/", **HX)
    assert response.status_code == 409
    assert "already at the effective limit (1)" in json.loads(response.content)["detail"]
    tenant.refresh_from_db()
    assert tenant.desired_count == 1
    assert _changes(tenant) == []


def test_deprovision_steps_down_and_stops_at_zero(writer_client, tenant):
    tenant.desired_count = 1
    tenant.save()
    assert writer_client.post("/console/tenants/acme/deprovision/", **HX).status_code == 204
    response = writer_client.post("/console/tenants/acme/deprovision/", **HX)
    assert response.status_code == 409
    assert "already 0" in json.loads(response.content)["detail"]
    tenant.refresh_from_db()
    assert tenant.desired_count == 0
    assert _changes(tenant) == [("desired_count", 1, 0, "manual", "console:wendy")]


def test_a_disabled_tenant_shows_why_it_cannot_scale(admin_client, writer_client, tenant):
    tenant.is_active = False
    tenant.save()
    # Its members lose it (like its keys and sockets); the platform admin sees why.
    assert writer_client.get("/console/tenants/acme/").status_code == 404
    body = admin_client.get("/console/tenants/acme/").content.decode()
    assert 'disabled title="tenant acme is disabled"' in body
    response = admin_client.post("/console/tenants/acme/provision/", **HX)
    assert response.status_code == 409


def test_a_platform_admin_sets_the_limit_override(admin_client, tenant):
    body = admin_client.get("/console/tenants/acme/").content.decode()
    assert "Platform overrides" in body and 'name="max_agents_override"' in body
    response = admin_client.post(
        "/console/tenants/acme/fleet-overrides/",
        {"max_agents_override": "10"},
        **HX,
    )
    assert response.status_code == 204
    tenant.refresh_from_db()
    assert tenant.max_agents_override == 10
    assert _changes(tenant) == [("max_agents_override", None, 10, "admin", "console:root")]


def test_lowering_the_limit_clamps_desired_count_in_the_audit(admin_client, tenant):
    tenant.desired_count = 4
    tenant.save()
    admin_client.post("/console/tenants/acme/fleet-overrides/", {"max_agents_override": "2"})
    tenant.refresh_from_db()
    assert (tenant.max_agents_override, tenant.desired_count) == (2, 2)
    assert ("desired_count", 4, 2, "clamp", "console:root") in _changes(tenant)


def test_an_empty_limit_clears_the_override(admin_client, tenant):
    tenant.max_agents_override = 9
    tenant.save()
    response = admin_client.post(
        "/console/tenants/acme/fleet-overrides/",
        {"max_agents_override": ""},
        **HX,
    )
    assert response.status_code == 204
    tenant.refresh_from_db()
    assert tenant.max_agents_override is None


def test_a_platform_admin_sets_desired_count(admin_client, tenant):
    response = admin_client.post(
        "/console/tenants/acme/fleet-overrides/",
        {"desired_count": "3"},
        **HX,
    )
    assert response.status_code == 204
    tenant.refresh_from_db()
    assert tenant.desired_count == 3
    assert _changes(tenant) == [("desired_count", 0, 3, "admin", "console:root")]


def test_desired_count_above_the_limit_is_refused(admin_client, tenant):
    response = admin_client.post(
        "/console/tenants/acme/fleet-overrides/",
        {"desired_count": "99"},
        **HX,
    )
    assert response.status_code == 422
    assert json.loads(response.content)["detail"] == (
        "acme: desired_count 99 exceeds the effective limit (4)"
    )
    tenant.refresh_from_db()
    assert tenant.desired_count == 0 and _changes(tenant) == []


def test_bad_override_input_is_a_400_naming_the_field(admin_client, tenant):
    for data, field in (
        ({"max_agents_override": "lots"}, "max_agents_override"),
        ({"desired_count": "-1"}, "desired_count"),
        ({"desired_count": ""}, "desired_count"),
    ):
        response = admin_client.post("/console/tenants/acme/fleet-overrides/", data, **HX)
        assert response.status_code == 400
        assert json.loads(response.content)["detail"].startswith(f"{field} must be")
    empty = admin_client.post("/console/tenants/acme/fleet-overrides/", {}, **HX)
    assert empty.status_code == 400
    tenant.refresh_from_db()
    assert (tenant.max_agents_override, tenant.desired_count) == (None, 0)


def test_a_tenant_writer_may_not_override(writer_client, tenant):
    # Write role lets a member provision, not raise its own ceiling.
    response = writer_client.post(
        "/console/tenants/acme/fleet-overrides/",
        {"max_agents_override": "50"},
        **HX,
    )
    assert response.status_code == 403
    assert json.loads(response.content)["detail"] == "only a platform admin may do this"
    tenant.refresh_from_db()
    assert tenant.max_agents_override is None


def _build_job(tenant, triple: str, **fields):
    import uuid

    from artifacts.models import BuildJob
    from artifacts.store.services import publish_package
    from artifacts.store.testing import build_archive, package_files

    files = {**package_files(kind="native"), "requirements.txt": "fakeext==1.0\n"}
    package, _ = publish_package(tenant, build_archive(files))
    return BuildJob.objects.create(
        id=uuid.uuid4(), tenant=tenant, package=package, package_name=package.name,
        version=package.version, target_triple=triple, **fields,
    )  # fmt: skip


def test_the_page_shows_builds_and_polls_only_while_one_is_active(reader_client, tenant):
    now = timezone.now()
    ok = _build_job(
        tenant, "aarch64-unknown-linux-gnu", state="succeeded", digest="ab" * 32,
        new_artifact=True, bytes_downloaded=2_500_000, started_at=now, finished_at=now,
    )  # fmt: skip
    failed = _build_job(
        tenant, "x86_64-unknown-linux-gnu", state="failed", error_kind="too_large",
        detail="pip download wrote more than 1048576 bytes", started_at=now, finished_at=now,
    )  # fmt: skip
    page = reader_client.get("/console/tenants/acme/").content.decode()
    assert 'id="tenant-builds"' in page and f'data-build="{ok.pk}"' in page
    part = reader_client.get("/console/tenants/acme/partials/builds/").content.decode()
    assert 'data-active="false"' in part and "hx-trigger" not in part.split("<table")[0]
    assert "hx-get" not in part  # without a trigger htmx would reload it on every click
    assert "build-succeeded" in part and "abababab" in part and "2.4\xa0MB" in part
    assert f'data-build="{failed.pk}"' in part and "413: pip download wrote more" in part
    _build_job(tenant, "aarch64-unknown-linux-musl", state="running", started_at=now)
    part = reader_client.get("/console/tenants/acme/partials/builds/").content.decode()
    assert 'data-active="true"' in part and 'hx-trigger="every 2s"' in part
    assert "build-running" in part
