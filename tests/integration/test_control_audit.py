"""Every change of a tenant's limits is audited, with the person's free-text reason
(issue 15 item 7): through REST, the console's tenant page and the Django admin, each
path with its actor; a reason too long is refused and changes nothing."""

from __future__ import annotations

import json

import pytest

from fleet.control import limits
from fleet.models import ApiKey, FleetChange, Tenant
from tests.support.console import HX, NO_MEMBERSHIPS, tenant_admin_form
from tests.support.keys import bearer

LONG = "x" * (limits.REASON_MAX_CHARS + 1)
LIMIT_FIELDS = ("desired_count", "max_agents_override", "max_backlog", "is_active")


def _rows(tenant: Tenant) -> list[tuple]:
    return list(
        FleetChange.objects.filter(tenant=tenant)
        .order_by("id")
        .values_list("field", "old_value", "new_value", "reason", "actor", "note")
    )


def _limits(tenant: Tenant) -> tuple:
    tenant.refresh_from_db()
    return tuple(getattr(tenant, f) for f in LIMIT_FIELDS)


def _post_json(client, path: str, body: object, key: str):
    return client.post(
        f"/api/v1{path}", data=json.dumps(body), content_type="application/json", **bearer(key)
    )


def _put_fleet(client, tenant: Tenant, body: dict, key: str):
    return client.put(
        f"/api/v1/admin/tenants/{tenant.name}/fleet",
        data=json.dumps(body),
        content_type="application/json",
        **bearer(key),
    )


def _lookup(token: str) -> str:
    return ApiKey.verify(token).lookup


# -- REST -------------------------------------------------------------------------------
def test_provision_and_deprovision_keep_the_reason(client, tenant, write_key, read_key):
    actor = f"write key {_lookup(write_key)}"
    up = _post_json(client, "/fleet/provision", {"reason": "  nightly ETL backlog  "}, write_key)
    assert up.status_code == 200, up.content
    down = _post_json(client, "/fleet/deprovision", {"reason": "backlog drained"}, write_key)
    assert down.status_code == 200 and down.json()["desired_count"] == 0
    assert _rows(tenant) == [
        ("desired_count", 0, 1, "manual", actor, "nightly ETL backlog"),
        ("desired_count", 1, 0, "manual", actor, "backlog drained"),
    ]
    history = client.get("/api/v1/fleet/history", **bearer(read_key)).json()["changes"]
    assert [c["note"] for c in history] == ["backlog drained", "nightly ETL backlog"]


def test_provision_without_a_body_still_works_and_has_no_reason(client, tenant, write_key):
    assert client.post("/api/v1/fleet/provision", **bearer(write_key)).status_code == 200
    assert _post_json(client, "/fleet/provision", {}, write_key).status_code == 200
    form = client.post(
        "/api/v1/fleet/provision",
        data="a=b",
        content_type="application/x-www-form-urlencoded",
        **bearer(write_key),
    )
    assert form.status_code == 200
    assert [row[5] for row in _rows(tenant)] == ["", "", ""]


@pytest.mark.parametrize(
    ("raw", "content_type", "status"),
    [
        (b'{"reason": NaN}', "", 422),
        (b'{"reason": "x", "reason2": 1}', "text/plain", 422),
        (b"not json", "text/plain", 400),
        (b"\xed\xa0\x80", "application/json", 400),
    ],
)
def test_a_body_of_another_type_is_read_as_json(
    client, tenant, write_key, raw, content_type, status
):
    res = client.post(
        "/api/v1/fleet/provision", data=raw, content_type=content_type, **bearer(write_key)
    )
    assert res.status_code == status, res.content
    assert res.json()["detail"]
    assert _limits(tenant)[0] == 0 and not FleetChange.objects.exists()


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"reason": LONG}, 422, "reason"),
        ({"reason": "two\nlines"}, 422, "body.reason"),
        ({"reason": "nul\u0000"}, 422, "NUL character"),
        ({"reason": 7}, 422, "body.reason: must be a string"),
        ({"reason": "ok", "desired_count": 3}, 422, "desired_count"),
        (["reason"], 422, "JSON object"),
    ],
)
def test_a_bad_reason_is_refused_and_changes_nothing(
    client, tenant, write_key, body, status, words
):
    for path in ("/fleet/provision", "/fleet/deprovision"):
        res = _post_json(client, path, body, write_key)
        assert res.status_code == status, res.content
        assert words in res.json()["detail"]
    assert _limits(tenant) == (0, None, 0, True)
    assert not FleetChange.objects.exists()


def test_a_too_long_reason_names_the_limit(client, tenant, write_key):
    res = _post_json(client, "/fleet/provision", {"reason": LONG}, write_key)
    assert res.status_code == 422
    assert "reason" in res.json()["detail"] and "300" in res.json()["detail"]
    # Past the schema (which counts raw characters) the service still bounds what it stores.
    with pytest.raises(limits.FleetLimitError, match="at most 300 characters, got 301"):
        limits.provision(tenant, "test", LONG)
    assert _limits(tenant)[0] == 0


def test_the_admin_api_keeps_the_reason(client, tenant, admin_key, read_key):
    actor = f"admin key {_lookup(admin_key)}"
    tenant.desired_count = 3
    tenant.save()
    res = _put_fleet(client, tenant, {"max_agents_override": 2, "reason": "INC-42"}, admin_key)
    assert res.status_code == 200, res.content
    assert _rows(tenant) == [
        ("max_agents_override", None, 2, "admin", actor, "INC-42"),
        ("desired_count", 3, 2, "clamp", actor, "max_agents_override lowered to 2; INC-42"),
    ]
    history = client.get("/api/v1/fleet/history", **bearer(read_key)).json()["changes"]
    assert {c["note"] for c in history} == {"INC-42", "max_agents_override lowered to 2; INC-42"}
    # Setting the same value again writes nothing.
    assert _put_fleet(client, tenant, {"max_agents_override": 2}, admin_key).status_code == 200
    assert len(_rows(tenant)) == 2


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"desired_count": 2, "reason": LONG}, "reason"),
        ({"desired_count": 2, "reason": "a\tb"}, "reason: String should match pattern"),
        ({"desired_count": 2, "reason": None}, "reason: must be a string"),
        ({"reason": "only a reason"}, "max_agents_override and/or desired_count"),
        # max_backlog and is_active are the Django admin's (audited there), not this endpoint's
        ({"max_backlog": 10, "reason": "x"}, "max_backlog"),
    ],
)
def test_bad_admin_input_with_a_reason_changes_nothing(client, tenant, admin_key, body, words):
    res = _put_fleet(client, tenant, body, admin_key)
    assert res.status_code == 422, res.content
    assert words in res.json()["detail"]
    assert _limits(tenant) == (0, None, 0, True)
    assert not FleetChange.objects.exists()


def test_the_openapi_document_shows_the_reason_bodies(client):
    spec = client.get("/api/v1/openapi.json").json()
    body = spec["paths"]["/api/v1/fleet/provision"]["post"]["requestBody"]
    assert body["required"] is False
    schema = body["content"]["application/json"]["schema"]
    assert schema["properties"]["reason"]["maxLength"] == limits.REASON_MAX_CHARS
    assert schema["properties"]["reason"]["pattern"] == limits.REASON_PATTERN
    admin = spec["components"]["schemas"]["AdminFleetIn"]["properties"]
    assert admin["reason"]["maxLength"] == limits.REASON_MAX_CHARS


# -- the console's tenant page --------------------------------------------------------
def test_a_console_provision_keeps_the_reason_and_shows_it(writer_client, tenant):
    response = writer_client.post(
        "/console/tenants/acme/provision/", {"reason": "demo for the board"}, **HX
    )
    assert response.status_code == 204
    assert _rows(tenant) == [
        ("desired_count", 0, 1, "manual", "console:wendy", "demo for the board")
    ]
    audit = writer_client.get("/console/tenants/acme/partials/changes/").content.decode()
    assert "manual: demo for the board" in audit


def test_the_tenant_page_has_a_reason_field_the_poll_keeps(writer_client, tenant):
    page = writer_client.get("/console/tenants/acme/").content.decode()
    field = page[
        page.index('id="scale-reason-acme"') - 200 : page.index('id="scale-reason-acme"') + 300
    ]
    assert 'name="reason"' in field and 'hx-preserve="true"' in field
    assert f'maxlength="{limits.REASON_MAX_CHARS}"' in field
    # the polled partial renders it with the same id, so htmx keeps what is being typed
    fleet = writer_client.get("/console/tenants/acme/partials/fleet/").content.decode()
    assert 'id="scale-reason-acme"' in fleet
    # Enter in the field must not scale: the form's default button is a disabled one
    form = page[page.rindex("<form", 0, page.index('id="scale-reason-acme"')) :]
    first_button = form[form.index("<button") : form.index(">", form.index("<button"))]
    assert "disabled" in first_button and "hidden" in first_button
    # the overview's compact buttons have no reason field
    overview = writer_client.get("/console/").content.decode()
    assert 'name="reason"' not in overview


def test_a_plain_console_form_post_carries_the_reason(writer_client, tenant):
    response = writer_client.post(
        "/console/tenants/acme/provision/", {"reason": "no-JS browser", "next": "/console/"}
    )
    assert response.status_code == 302
    assert _rows(tenant)[0][5] == "no-JS browser"


def test_a_console_override_keeps_the_reason(admin_client, tenant):
    tenant.desired_count = 4
    tenant.save()
    response = admin_client.post(
        "/console/tenants/acme/fleet-overrides/",
        {"max_agents_override": "2", "reason": "cost cut"},
        **HX,
    )
    assert response.status_code == 204
    assert _rows(tenant) == [
        ("max_agents_override", None, 2, "admin", "console:root", "cost cut"),
        ("desired_count", 4, 2, "clamp", "console:root", "max_agents_override lowered to 2; cost cut"),
    ]  # fmt: skip
    page = admin_client.get("/console/tenants/acme/").content.decode()
    overrides = page[page.index('id="overrides"') :]
    assert overrides.count('name="reason"') == 2  # one per override form


def test_a_too_long_console_reason_is_refused_and_changes_nothing(admin_client, tenant):
    for url, data in (
        ("/console/tenants/acme/provision/", {"reason": LONG}),
        ("/console/tenants/acme/deprovision/", {"reason": LONG}),
        ("/console/tenants/acme/fleet-overrides/", {"desired_count": "2", "reason": LONG}),
    ):
        response = admin_client.post(url, data, **HX)
        assert response.status_code == 422, url
        assert "reason must be at most 300 characters" in json.loads(response.content)["detail"]
    assert _limits(tenant) == (0, None, 0, True)
    assert not FleetChange.objects.exists()


def test_the_console_audit_shows_is_active_in_words(admin_client, tenant):
    limits.set_tenant_limits(tenant, "admin:root", "offboarding", is_active=False)
    audit = admin_client.get("/console/tenants/acme/partials/changes/").content.decode()
    assert "active → disabled" in audit and "admin: offboarding" in audit


# -- the Django admin -----------------------------------------------------------------


def test_the_admin_change_form_audits_every_limit_as_the_admin_user(admin_client, tenant):
    url = f"/admin/fleet/tenant/{tenant.pk}/change/"
    assert 'name="reason"' in admin_client.get(url).content.decode()
    response = admin_client.post(
        url,
        tenant_admin_form(
            tenant,
            is_active="",
            max_backlog="250",
            storage_quota_bytes=str(10 * 2**30),  # past a 32-bit column
            desired_count="2",
            reason="customer paused the contract",
        ),
    )
    assert response.status_code == 302, response.content.decode()[:3000]
    note = "customer paused the contract"
    assert sorted(_rows(tenant)) == [
        ("desired_count", 0, 2, "admin", "admin:root", note),
        ("is_active", 1, 0, "admin", "admin:root", note),
        ("max_backlog", 0, 250, "admin", "admin:root", note),
        ("storage_quota_bytes", None, 10 * 2**30, "admin", "admin:root", note),
    ]
    assert _limits(tenant) == (2, None, 250, False)
    # a reason alone changes nothing and records nothing
    tenant.refresh_from_db()
    again = admin_client.post(url, tenant_admin_form(tenant, reason="just looking"))
    assert again.status_code == 302
    assert len(_rows(tenant)) == 4


def test_a_too_long_admin_reason_is_a_form_error_and_changes_nothing(admin_client, tenant):
    url = f"/admin/fleet/tenant/{tenant.pk}/change/"
    response = admin_client.post(url, tenant_admin_form(tenant, max_backlog="9", reason=LONG))
    assert response.status_code == 200  # the admin re-renders the form with the error
    assert "at most 300 characters" in response.content.decode()
    assert _limits(tenant) == (0, None, 0, True)
    assert not FleetChange.objects.exists()


def test_adding_a_tenant_in_the_admin_audits_its_non_default_limits(admin_client, db):
    response = admin_client.post(
        "/admin/fleet/tenant/add/",
        {
            "name": "initech",
            "is_active": "",
            "max_agents_override": "",
            "max_backlog": "40",
            "reason": "pilot, starts disabled",
            **NO_MEMBERSHIPS,
        },
    )
    assert response.status_code == 302, response.content.decode()[:3000]
    tenant = Tenant.objects.get(name="initech")
    assert (tenant.is_active, tenant.max_backlog) == (False, 40)
    assert [r for r in _rows(tenant) if r[3] != "seed"] == [
        ("max_backlog", 0, 40, "admin", "admin:root", "pilot, starts disabled"),
        ("is_active", 1, 0, "admin", "admin:root", "pilot, starts disabled"),
    ]


# -- the service ------------------------------------------------------------------------
def test_set_tenant_limits_checks_everything_before_writing(tenant):
    for kwargs, words in (
        ({"max_backlog": 2**31}, "max_backlog must be an integer from 0 to"),
        ({"storage_quota_bytes": -1}, "storage_quota_bytes"),
        ({"is_active": 1}, "is_active must be true or false"),
        ({"is_active": False, "max_agents_override": -1}, "max_agents_override"),
    ):
        with pytest.raises(limits.FleetLimitError, match=words):
            limits.set_tenant_limits(tenant, "test", "", **kwargs)
    assert _limits(tenant) == (0, None, 0, True)
    assert not FleetChange.objects.exists()
    limits.set_tenant_limits(tenant, "test", storage_quota_bytes=None, max_backlog=0)
    assert not FleetChange.objects.exists()  # unchanged values: no rows
