"""Django admin for the platform: changelists, fleet overrides via the control plane, key revoke."""

from __future__ import annotations

import pytest

from agents.models import Agent
from fleet.executors.fleet.lifecycle import revoke_key
from fleet.models import ApiKey, FleetChange, Tenant
from tests.support.console import NO_MEMBERSHIPS, make_agent, make_eviction, tenant_admin_form
from tests.support.factories import publish_example

CHANGELISTS = [
    "/admin/fleet/tenant/",
    "/admin/fleet/tenantmembership/",
    "/admin/fleet/apikey/",
    "/admin/fleet/eviction/",
    "/admin/fleet/deliveryoutbox/",
    "/admin/fleet/fleetchange/",
    "/admin/fleet/autoscaledecision/",
    "/admin/agents/agent/",
    "/admin/artifacts/workflowpackage/",
    "/admin/artifacts/packageartifact/",
    "/admin/artifacts/artifactblob/",
]


@pytest.fixture
def fleet_data(tenant):
    package = publish_example(tenant)
    agent = make_agent(tenant, "a1", state="dead")
    make_eviction(agent)
    ApiKey.mint("write", tenant=tenant, label="ci")
    return package


@pytest.mark.parametrize("url", CHANGELISTS)
def test_every_changelist_loads(url, admin_client, fleet_data):
    assert admin_client.get(url).status_code == 200


def test_only_platform_admins_get_in(writer_client, db):
    response = writer_client.get("/admin/fleet/tenant/")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


def test_records_are_read_only(admin_client, fleet_data, tenant):
    from fleet.models import Eviction

    eviction = Eviction.objects.get()
    agent = Agent.objects.get()
    for url in ("/admin/fleet/eviction/add/", "/admin/agents/agent/add/",
                "/admin/artifacts/workflowpackage/add/", "/admin/fleet/deliveryoutbox/add/"):  # fmt: skip
        assert admin_client.get(url).status_code == 403, url
    view = admin_client.get(f"/admin/fleet/eviction/{eviction.pk}/change/")
    assert view.status_code == 200 and b'name="_save"' not in view.content
    before = agent.name
    admin_client.post(f"/admin/agents/agent/{agent.pk}/change/", {"name": "renamed"})
    agent.refresh_from_db()
    assert agent.name == before
    assert admin_client.post(f"/admin/fleet/eviction/{eviction.pk}/delete/").status_code == 403


def test_a_blob_page_never_renders_its_bytes(admin_client, fleet_data):
    body = admin_client.get(f"/admin/artifacts/artifactblob/{fleet_data.digest}/change/").content
    assert fleet_data.digest.encode() in body
    assert b"Data" not in body and b"memory at" not in body


def test_keys_are_listed_without_any_secret(admin_client, tenant):
    key, token = ApiKey.mint("write", tenant=tenant, label="ci")
    changelist = admin_client.get("/admin/fleet/apikey/").content.decode()
    detail = admin_client.get(f"/admin/fleet/apikey/{key.pk}/change/").content.decode()
    for body in (changelist, detail):
        assert key.lookup in body
        assert key.key_hash not in body
        assert token.split("_", 2)[2] not in body
        assert "key_hash" not in body
    assert admin_client.get("/admin/fleet/apikey/add/").status_code == 403  # mint on the CLI


def test_the_revoke_action_revokes_keys(admin_client, tenant):
    key, token = ApiKey.mint("write", tenant=tenant)
    other, _ = ApiKey.mint("read", tenant=tenant)
    already, _ = ApiKey.mint("agent", tenant=tenant)
    revoke_key(already)
    response = admin_client.post(
        "/admin/fleet/apikey/",
        {"action": "revoke", "index": "0", "_selected_action": [key.pk, already.pk]},
        follow=True,
    )
    assert b"Revoked 1 key(s); 1 already revoked" in response.content
    key.refresh_from_db()
    other.refresh_from_db()
    assert key.revoked_at is not None and other.revoked_at is None
    assert ApiKey.verify(token) is None


def test_keys_cannot_be_deleted(admin_client, tenant):
    key, _ = ApiKey.mint("write", tenant=tenant)
    assert admin_client.post(f"/admin/fleet/apikey/{key.pk}/delete/").status_code == 403
    assert ApiKey.objects.filter(pk=key.pk).exists()


def test_editing_fleet_numbers_goes_through_the_control_plane(admin_client, tenant):
    url = f"/admin/fleet/tenant/{tenant.pk}/change/"
    response = admin_client.post(
        url, tenant_admin_form(tenant, max_agents_override="8", desired_count="5")
    )
    assert response.status_code == 302, response.content.decode()[:3000]
    tenant.refresh_from_db()
    assert (tenant.max_agents_override, tenant.desired_count) == (8, 5)
    assert sorted(
        FleetChange.objects.filter(tenant=tenant).values_list(
            "field", "old_value", "new_value", "reason", "actor"
        )
    ) == [
        ("desired_count", 0, 5, "admin", "admin:root"),
        ("max_agents_override", None, 8, "admin", "admin:root"),
    ]


def test_an_admin_edit_above_the_limit_is_a_form_error(admin_client, tenant):
    url = f"/admin/fleet/tenant/{tenant.pk}/change/"
    response = admin_client.post(url, tenant_admin_form(tenant, desired_count="50"))
    assert response.status_code == 200
    assert b"desired_count 50 exceeds the effective limit (4)" in response.content
    tenant.refresh_from_db()
    assert tenant.desired_count == 0
    assert not FleetChange.objects.filter(tenant=tenant).exists()


FLEET_NUMBERS = ("desired_count", "max_agents_override")


def test_saving_a_tenant_without_fleet_changes_writes_no_audit(admin_client, tenant):
    url = f"/admin/fleet/tenant/{tenant.pk}/change/"
    response = admin_client.post(url, tenant_admin_form(tenant, max_backlog="100"))
    assert response.status_code == 302
    tenant.refresh_from_db()
    assert tenant.max_backlog == 100
    # No fleet-number row; the max_backlog change itself is audited (issue 15 item 7).
    assert not FleetChange.objects.filter(tenant=tenant, field__in=FLEET_NUMBERS).exists()
    assert list(FleetChange.objects.filter(tenant=tenant).values_list("field", flat=True)) == [
        "max_backlog"
    ]
    # Saving the unchanged form writes nothing at all.
    assert admin_client.post(url, tenant_admin_form(tenant)).status_code == 302
    assert FleetChange.objects.filter(tenant=tenant).count() == 1


def test_the_storage_quota_override_is_edited_in_the_admin(admin_client, tenant):
    url = f"/admin/fleet/tenant/{tenant.pk}/change/"
    page = admin_client.get(url).content.decode()
    assert 'name="storage_quota_bytes"' in page
    assert "0 / 1073741824 bytes (CLOACINA_TENANT_STORAGE_BYTES)" in page
    response = admin_client.post(url, tenant_admin_form(tenant, storage_quota_bytes="5000000"))
    assert response.status_code == 302, response.content.decode()[:3000]
    tenant.refresh_from_db()
    assert tenant.storage_quota_bytes == 5_000_000
    assert not FleetChange.objects.filter(tenant=tenant, field__in=FLEET_NUMBERS).exists()
    assert list(
        FleetChange.objects.filter(tenant=tenant).values_list("field", "old_value", "new_value")
    ) == [("storage_quota_bytes", None, 5_000_000)]
    page = admin_client.get(url).content.decode()
    assert "0 / 5000000 bytes (tenant acme&#x27;s storage_quota_bytes)" in page
    # Emptied: back to the platform default.
    assert (
        admin_client.post(url, tenant_admin_form(tenant, storage_quota_bytes="")).status_code == 302
    )
    tenant.refresh_from_db()
    assert tenant.storage_quota_bytes is None


def test_inline_list_edits_use_the_control_plane_too(admin_client, tenant):
    response = admin_client.post(
        "/admin/fleet/tenant/",
        {
            "form-TOTAL_FORMS": "1",
            "form-INITIAL_FORMS": "1",
            "form-0-id": tenant.pk,
            "form-0-max_agents_override": "",
            "form-0-desired_count": "2",
            "_save": "Save",
        },
    )
    assert response.status_code == 302
    tenant.refresh_from_db()
    assert tenant.desired_count == 2
    assert FleetChange.objects.get(tenant=tenant).actor == "admin:root"


def test_adding_a_tenant_seeds_it_like_the_cli(admin_client, db):
    response = admin_client.post(
        "/admin/fleet/tenant/add/",
        {
            "name": "initech",
            "is_active": "on",
            "max_agents_override": "3",
            "max_backlog": "0",
            **NO_MEMBERSHIPS,
        },
    )
    assert response.status_code == 302, response.content.decode()[:3000]
    tenant = Tenant.objects.get(name="initech")
    assert tenant.max_agents_override == 3
    assert set(FleetChange.objects.filter(tenant=tenant).values_list("field", "reason")) == {
        ("desired_count", "seed"),
        ("max_agents_override", "seed"),
    }
    bad = admin_client.post("/admin/fleet/tenant/add/", {"name": "Bad Name!", "max_backlog": "0"})
    assert bad.status_code == 200 and not Tenant.objects.filter(name="Bad Name!").exists()
