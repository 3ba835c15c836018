"""Cross-cutting console rules, checked on every page, partial and action.

Anonymous → login; wrong method → 405; another tenant's object → 404; a
read-only member's POST → 403 with nothing changed; POST without CSRF → 403.
"""

from __future__ import annotations

import json

import pytest
from django.test import Client

from tests.support.console import HX, client_for, with_password
from tests.support.factories import publish_example, start

TENANT_PAGES = [
    "/console/tenants/acme/",
    "/console/tenants/acme/partials/fleet/",
    "/console/tenants/acme/partials/agents/",
    "/console/tenants/acme/partials/decisions/",
    "/console/tenants/acme/partials/changes/",
]
EXECUTION_PAGES = [
    "/console/executions/{id}/",
    "/console/executions/{id}/partials/graph/",
    "/console/executions/{id}/tasks/extract/log/",
    "/console/executions/{id}/tasks/extract/log/partials/panel/",
]
LIST_PAGES = [
    "/console/",
    "/console/partials/overview/",
    "/console/evictions/",
    "/console/evictions/partials/table/",
    "/console/outbox/",
    "/console/outbox/partials/depth/",
    "/console/executions/",
    "/console/executions/partials/table/",
]
ALL_GET_PAGES = LIST_PAGES + TENANT_PAGES + EXECUTION_PAGES
ACTIONS = [
    "/console/tenants/acme/provision/",
    "/console/tenants/acme/deprovision/",
    "/console/tenants/acme/fleet-overrides/",
    "/console/executions/{id}/cancel/",
]
# List pages filtered by a tenant the user cannot see.
FILTERED_LISTS = [
    "/console/evictions/?tenant=acme",
    "/console/evictions/partials/table/?tenant=acme",
    "/console/outbox/?tenant=acme",
    "/console/outbox/partials/depth/?tenant=acme",
    "/console/executions/?tenant=acme",
    "/console/executions/partials/table/?tenant=acme",
]


@pytest.fixture
def execution(tenant):
    publish_example(tenant)
    return start(tenant, "etl", {})[0]


def _url(template: str, execution) -> str:
    return template.format(id=execution.pk)


@pytest.mark.parametrize("page", ALL_GET_PAGES)
def test_it_shows_every_page_to_a_member(page, reader_client, execution):
    response = reader_client.get(_url(page, execution))
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/html")


@pytest.mark.parametrize("page", ALL_GET_PAGES)
def test_it_redirects_anonymous_users_to_login(page, anon_client, execution):
    url = _url(page, execution)
    response = anon_client.get(url)
    assert response.status_code == 302
    assert response["Location"].startswith("/console/login/?next=")


def test_it_sends_a_polling_anonymous_page_to_login_as_a_whole(anon_client, tenant):
    # An expired session must not swap the login form into a table cell.
    response = anon_client.get(
        "/console/partials/overview/", HTTP_HX_CURRENT_URL="http://x/console/outbox/", **HX
    )
    assert response.status_code == 401
    assert response["HX-Redirect"].startswith("/console/login/?next=")
    assert "console/outbox/" in response["HX-Redirect"]


@pytest.mark.parametrize("page", ALL_GET_PAGES)
def test_it_refuses_post_on_pages(page, admin_client, execution):
    response = admin_client.post(_url(page, execution))
    assert response.status_code == 405
    assert response["Allow"] == "GET"


@pytest.mark.parametrize("action", ACTIONS)
def test_it_refuses_get_on_actions(action, admin_client, execution):
    response = admin_client.get(_url(action, execution))
    assert response.status_code == 405
    assert response["Allow"] == "POST"


@pytest.mark.parametrize("page", TENANT_PAGES + EXECUTION_PAGES + FILTERED_LISTS)
def test_it_answers_another_tenants_pages_with_404(page, outsider_client, execution):
    assert outsider_client.get(_url(page, execution)).status_code == 404


@pytest.mark.parametrize("action", ACTIONS)
def test_it_answers_another_tenants_actions_with_404(action, outsider_client, execution, tenant):
    response = outsider_client.post(_url(action, execution), {"desired_count": "1"}, **HX)
    assert response.status_code == 404
    tenant.refresh_from_db()
    execution.refresh_from_db()
    assert (tenant.desired_count, execution.status) == (0, "Pending")


@pytest.mark.parametrize("action", ACTIONS)
def test_it_forbids_actions_to_a_read_only_member(action, reader_client, execution, tenant):
    from fleet.models import FleetChange

    response = reader_client.post(_url(action, execution), {"desired_count": "1"}, **HX)
    assert response.status_code == 403
    assert json.loads(response.content)["detail"]
    tenant.refresh_from_db()
    execution.refresh_from_db()
    assert (tenant.desired_count, execution.status) == (0, "Pending")
    assert not FleetChange.objects.filter(tenant=tenant).exists()


def test_a_forbidden_plain_form_post_gets_an_error_page(reader_client, tenant):
    response = reader_client.post("/console/tenants/acme/provision/")
    assert response.status_code == 403
    assert b"read-only" in response.content
    assert b"<html" in response.content


@pytest.mark.parametrize("action", ACTIONS)
def test_it_redirects_anonymous_actions_to_login(action, anon_client, execution, tenant):
    response = anon_client.post(_url(action, execution))
    assert response.status_code == 302
    tenant.refresh_from_db()
    assert tenant.desired_count == 0


def test_it_requires_the_csrf_token(writer_user, tenant):
    client = Client(enforce_csrf_checks=True)
    client.force_login(writer_user)
    assert client.post("/console/tenants/acme/provision/", **HX).status_code == 403
    tenant.refresh_from_db()
    assert tenant.desired_count == 0
    # The token every console page puts in hx-headers makes the same POST pass.
    page = client.get("/console/tenants/acme/")
    token = page.cookies["csrftoken"].value
    response = client.post("/console/tenants/acme/provision/", HTTP_X_CSRFTOKEN=token, **HX)
    assert response.status_code == 204
    tenant.refresh_from_db()
    assert tenant.desired_count == 1


def test_every_page_carries_the_csrf_header_for_htmx(writer_client, tenant):
    body = writer_client.get("/console/").content.decode()
    assert 'hx-headers=\'{"X-CSRFToken": "' in body
    assert "/static/htmx.min.js" in body


def test_login_and_logout(tenant, writer_user):
    with_password(writer_user)
    client = Client()
    page = client.get("/console/login/")
    assert page.status_code == 200 and b'name="password"' in page.content
    bad = client.post("/console/login/", {"username": "wendy", "password": "nope"})
    assert bad.status_code == 200 and b"Wrong username or password" in bad.content
    good = client.post(
        "/console/login/", {"username": "wendy", "password": "pw-123456", "next": "/console/"}
    )
    assert good.status_code == 302 and good["Location"] == "/console/"
    assert client.get("/console/").status_code == 200
    assert client.get("/console/logout/").status_code == 405  # logout is POST only
    assert client.post("/console/logout/").status_code == 302
    assert client.get("/console/").status_code == 302


def test_a_user_without_membership_sees_no_tenant(db, tenant):
    from django.contrib.auth import get_user_model

    nobody = get_user_model().objects.create_user("nobody", "n@example.com", None)
    client = client_for(nobody)
    assert b"No tenants visible to you" in client.get("/console/").content
    assert client.get("/console/tenants/acme/").status_code == 404


def test_htmx_errors_are_json_details(writer_client):
    response = writer_client.get("/console/evictions/partials/table/?range=forever", **HX)
    assert response.status_code == 400
    assert json.loads(response.content) == {
        "detail": "range must be one of 15m, 1h, 6h, 24h, 7d, 30d, all, got 'forever'"
    }


def _deactivate(tenant) -> None:
    from fleet.models import Tenant

    Tenant.objects.filter(pk=tenant.pk).update(is_active=False)


@pytest.mark.parametrize("page", TENANT_PAGES + EXECUTION_PAGES + FILTERED_LISTS)
def test_a_deactivated_tenants_members_lose_its_pages(page, reader_client, execution, tenant):
    _deactivate(tenant)
    assert reader_client.get(_url(page, execution)).status_code == 404


@pytest.mark.parametrize("action", ACTIONS)
def test_a_deactivated_tenants_writers_lose_its_actions(action, writer_client, execution, tenant):
    from fleet.models import Tenant, WorkflowExecution

    _deactivate(tenant)
    response = writer_client.post(_url(action, execution))
    assert response.status_code == 404
    assert Tenant.objects.get(pk=tenant.pk).desired_count == tenant.desired_count
    assert WorkflowExecution.objects.get(pk=execution.pk).status == execution.status


def test_a_deactivated_tenant_leaves_its_members_lists_and_stays_with_the_admin(
    reader_client, admin_client, execution, tenant
):
    _deactivate(tenant)
    overview = reader_client.get("/console/").content.decode()
    assert "/console/tenants/acme/" not in overview
    assert str(execution.pk) not in reader_client.get("/console/executions/").content.decode()
    assert admin_client.get("/console/tenants/acme/").status_code == 200
