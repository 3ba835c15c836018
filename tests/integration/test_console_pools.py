"""The tenant page's agent pools: the table, per-pool provision/deprovision, create, edit
and delete through the control plane, for a writer, a reader and an outsider."""

from __future__ import annotations

import json

from fleet.control import pools
from fleet.models import AgentPool, FleetChange
from tests.support.console import HX


def test_the_page_lists_the_pools_and_the_partial_polls(reader_client, tenant):
    pools.create_pool(tenant, "t", "gpu", {"tags": ["gpu"], "gpu": 1, "memory": "8Gi"})
    body = reader_client.get("/console/tenants/acme/").content.decode()
    assert 'data-pool="default"' in body and 'data-pool="gpu"' in body
    assert "8Gi, 1 GPU" in body
    assert 'id="create-pool"' not in body  # a reader gets no forms
    part = reader_client.get("/console/tenants/acme/partials/pools/").content.decode()
    assert part.lstrip().startswith("<section") and 'hx-trigger="every 2s' in part
    assert 'aria-label="provision one agent for pool gpu"' in part and "disabled" in part


def test_a_writer_creates_provisions_edits_and_deletes_a_pool(writer_client, tenant):
    res = writer_client.post(
        "/console/tenants/acme/pools/",
        {"name": "gpu", "tags": "gpu, a100", "capabilities": "cuda", "max_concurrency": "1",
         "cpu": "2", "memory": "8Gi", "gpu": "1"},
        **HX,
    )  # fmt: skip
    assert res.status_code == 204, res.content
    pool = AgentPool.objects.get(tenant=tenant, name="gpu")
    assert (pool.tags, pool.capabilities, pool.max_concurrency) == (["a100", "gpu"], ["cuda"], 1)
    res = writer_client.post("/console/tenants/acme/pools/gpu/provision/", **HX)
    assert res.status_code == 204
    flash = json.loads(res["HX-Trigger"])["console-flash"]["message"]
    assert flash == "acme: pool gpu desired_count 0 → 1"
    res = writer_client.post(
        "/console/tenants/acme/pools/gpu/edit/", {"max_concurrency": "", "gpu": "2"}, **HX
    )
    assert res.status_code == 204
    pool.refresh_from_db()
    assert (pool.max_concurrency, pool.gpu) == (None, 2)
    assert writer_client.get("/console/tenants/acme/").content.decode().count("data-pool-form") == 2
    res = writer_client.post("/console/tenants/acme/pools/gpu/delete/", **HX)
    assert res.status_code == 204
    assert not AgentPool.objects.filter(tenant=tenant, name="gpu").exists()
    actors = set(FleetChange.objects.filter(tenant=tenant).values_list("actor", flat=True))
    assert actors == {"console:wendy"}


def test_bad_input_and_bounds_are_refused_and_change_nothing(writer_client, tenant):
    res = writer_client.post("/console/tenants/acme/pools/", {"name": "Bad Name"}, **HX)
    assert res.status_code == 422 and "pool name must be" in json.loads(res.content)["detail"]
    res = writer_client.post("/console/tenants/acme/pools/", {"name": "p", "gpu": "x"}, **HX)
    assert (
        res.status_code == 422 and "gpu must be a whole number" in json.loads(res.content)["detail"]
    )
    res = writer_client.post("/console/tenants/acme/pools/default/delete/", **HX)
    assert res.status_code == 409
    res = writer_client.post("/console/tenants/acme/pools/nope/provision/", **HX)
    assert res.status_code == 404
    res = writer_client.post("/console/tenants/acme/pools/default/deprovision/", **HX)
    assert res.status_code == 409 and "already 0" in json.loads(res.content)["detail"]
    assert not AgentPool.objects.filter(tenant=tenant).exclude(name="default").exists()
    tenant.refresh_from_db()
    assert tenant.desired_count == 0


def test_readers_and_outsiders_cannot_change_pools(reader_client, outsider_user, tenant):
    from tests.support.console import client_for

    pools.create_pool(tenant, "t", "gpu", {})
    assert reader_client.post("/console/tenants/acme/pools/gpu/provision/", **HX).status_code == 403
    outsider = client_for(outsider_user)
    assert outsider.post("/console/tenants/acme/pools/gpu/provision/", **HX).status_code == 404
    assert outsider.post("/console/tenants/acme/pools/", {"name": "x"}, **HX).status_code == 404
    assert AgentPool.objects.get(tenant=tenant, name="gpu").desired_count == 0


# -- the Django admin ------------------------------------------------------------------


def test_the_admin_lists_creates_and_steps_pools_through_the_control_plane(admin_client, tenant):
    pools.create_pool(tenant, "t", "gpu", {"tags": ["gpu"]})
    assert admin_client.get("/admin/fleet/agentpool/").status_code == 200
    res = admin_client.post(
        "/admin/fleet/agentpool/add/",
        {"tenant": tenant.pk, "name": "big", "tags": '["big"]', "capabilities": "[]",
         "max_concurrency": "8", "cpu": "4", "memory": "16Gi", "gpu": "0"},
    )  # fmt: skip
    assert res.status_code == 302, res.content.decode()[:2000]
    big = AgentPool.objects.get(tenant=tenant, name="big")
    assert (big.tags, big.max_concurrency, big.memory) == (["big"], 8, "16Gi")
    res = admin_client.post(
        "/admin/fleet/agentpool/add/",
        {"tenant": tenant.pk, "name": "bad", "tags": '["pool:x"]', "capabilities": "[]",
         "max_concurrency": "", "cpu": "", "memory": "", "gpu": "0"},
    )  # fmt: skip
    assert res.status_code == 200 and "is reserved" in res.content.decode()
    gpu = AgentPool.objects.get(tenant=tenant, name="gpu")
    res = admin_client.post(
        "/admin/fleet/agentpool/",
        {"action": "provision_one", "_selected_action": [gpu.pk]},
    )
    assert res.status_code == 302
    gpu.refresh_from_db()
    tenant.refresh_from_db()
    assert (gpu.desired_count, tenant.desired_count) == (1, 1)
    change = FleetChange.objects.filter(tenant=tenant, field="pool:gpu").latest("id")
    assert change.actor == "admin:root" and change.new_value == 1


def test_a_console_reason_lands_in_the_audit_note(writer_client, tenant):
    pools.create_pool(tenant, "t", "gpu", {})
    res = writer_client.post(
        "/console/tenants/acme/pools/gpu/provision/", {"reason": "batch tonight"}, **HX
    )
    assert res.status_code == 204
    change = FleetChange.objects.filter(tenant=tenant, field="pool:gpu").latest("id")
    assert (change.new_value, change.note, change.actor) == (1, "batch tonight", "console:wendy")
