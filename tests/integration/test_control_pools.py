"""Agent pools per tenant: REST, the limit on their sum, clamps, the per-pool autoscaler,
and tasks that wait for a pool instead of failing NoMatchingAgent.

Real PostgreSQL and the in-process API; agents are roster rows (tests/support/agents.py).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from fleet.control import limits, pools
from fleet.control.autoscaler import HOLD, UP, autoscale_tick
from fleet.control.reconciler import desired_pools
from fleet.executors.fleet.delivery.placement import NoAgent, Unroutable
from fleet.models import AgentPool, AutoscaleDecision, ChangeReason, FleetChange, Tenant
from fleet.platform.config import get_config, load_config, reset_config
from tests.support.agents import make_agent
from tests.support.keys import bearer
from tests.support.routing import agent, place_root, routed_package

pytestmark = pytest.mark.django_db


def post(client, path, key, body=None):
    return client.post(
        f"/api/v1/fleet/pools{path}",
        data=json.dumps(body or {}),
        content_type="application/json",
        **bearer(key),
    )


def patch(client, path, key, body):
    return client.patch(
        f"/api/v1/fleet/pools{path}",
        data=json.dumps(body),
        content_type="application/json",
        **bearer(key),
    )


def gpu_pool(client, key, **fields):
    body = {"name": "gpu", "tags": ["gpu"], "capabilities": ["cuda"], "max_concurrency": 1,
            "cpu": "2", "memory": "8Gi", "gpu": 1, **fields}  # fmt: skip
    res = post(client, "", key, body)
    assert res.status_code == 201, res.content
    return res.json()


def pool_counts(tenant) -> dict[str, int]:
    return {state.name: state.desired_count for state in pools.list_pools(tenant)}


@pytest.fixture
def with_actuator():
    """A server whose control plane runs an actuator (so a pool can grow by itself)."""
    from fleet.platform.config import apply_overrides

    apply_overrides(fleet_actuator="process")
    yield
    reset_config()


# -- REST ------------------------------------------------------------------------------


def test_every_tenant_lists_its_default_pool(client, tenant, read_key):
    res = client.get("/api/v1/fleet/pools", **bearer(read_key))
    assert res.status_code == 200
    body = res.json()
    assert body["desired_count"] == 0
    [default] = body["pools"]
    assert (default["name"], default["default"], default["desired_count"]) == ("default", True, 0)
    assert AgentPool.objects.filter(tenant=tenant, name="default").count() == 1


def test_it_creates_a_pool_and_provisions_it_within_the_limit(client, tenant, write_key):
    created = gpu_pool(client, write_key)
    assert created["desired_count"] == 0 and created["tags"] == ["gpu"]
    assert (created["cpu"], created["memory"], created["gpu"]) == ("2", "8Gi", 1)
    assert client.post("/api/v1/fleet/provision", **bearer(write_key)).status_code == 200
    for n in (1, 2, 3):
        res = post(client, "/gpu/provision", write_key)
        assert res.status_code == 200, res.content
        assert res.json()["desired_count"] == n
    # 1 default + 3 gpu = the limit (4): neither pool may grow.
    res = post(client, "/gpu/provision", write_key)
    assert res.status_code == 409
    assert "effective limit (4 agents)" in res.json()["detail"]
    assert client.post("/api/v1/fleet/provision", **bearer(write_key)).status_code == 409
    tenant.refresh_from_db()
    assert tenant.desired_count == 4
    assert pool_counts(tenant) == {"default": 1, "gpu": 3}
    fleet = client.get("/api/v1/fleet", **bearer(write_key)).json()
    assert fleet["desired_count"] == 4  # GET /fleet keeps the tenant total
    fields = list(
        FleetChange.objects.filter(tenant=tenant).order_by("id").values_list("field", flat=True)
    )
    assert fields.count("pool:gpu") == 4  # created + 3 provisions
    assert fields.count("desired_count") == 4


def test_deprovision_works_per_pool_and_stops_at_zero(client, tenant, write_key):
    gpu_pool(client, write_key)
    post(client, "/gpu/provision", write_key)
    res = post(client, "/gpu/deprovision", write_key)
    assert res.status_code == 200 and res.json()["desired_count"] == 0
    res = post(client, "/gpu/deprovision", write_key)
    assert res.status_code == 409
    assert res.json()["detail"] == (
        "pool 'gpu' desired_count is already 0; there is nothing to deprovision"
    )
    # CONTRACT.md's deprovision acts on the default pool: it never takes a named pool's agent.
    post(client, "/gpu/provision", write_key)
    res = client.post("/api/v1/fleet/deprovision", **bearer(write_key))
    assert res.status_code == 409
    assert "named pools hold all 1" in res.json()["detail"]
    assert pool_counts(tenant) == {"default": 0, "gpu": 1}


def test_the_default_pool_provisions_like_the_contracts_endpoint(client, tenant, write_key):
    res = post(client, "/default/provision", write_key)
    assert res.status_code == 200 and res.json()["desired_count"] == 1
    tenant.refresh_from_db()
    assert tenant.desired_count == 1


def test_it_updates_a_pools_labels(client, tenant, write_key):
    gpu_pool(client, write_key)
    res = patch(client, "/gpu", write_key, {"tags": ["gpu", "a100"], "max_concurrency": None})
    assert res.status_code == 200, res.content
    assert res.json()["tags"] == ["a100", "gpu"] and res.json()["max_concurrency"] is None
    res = patch(client, "/default", write_key, {"capabilities": ["etl"]})
    assert res.status_code == 200 and res.json()["capabilities"] == ["etl"]


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        ({"name": "GPU"}, "pool name must be"),
        ({"name": "-x"}, "pool name must be"),
        ({"name": "x" * 25}, "pool name must be"),
        ({"name": "p", "tags": ["pool:other"]}, "is reserved"),
        ({"name": "p", "tags": ["a,b"]}, "holds a comma"),
        ({"name": "p", "max_concurrency": 0}, "max_concurrency must be an integer in 1..1024"),
        ({"name": "p", "cpu": "lots"}, "cpu must be a Kubernetes quantity"),
        ({"name": "p", "memory": "2 GB"}, "memory must be a Kubernetes quantity"),
        ({"name": "p", "gpu": 99}, "gpu must be an integer in 0..16"),
        ({"name": "p", "colour": "red"}, "colour"),
        ({"name": "p", "tags": ["a\u0007b"]}, "a control character"),
        ({"name": "p", "capabilities": [" x"]}, "surrounding spaces"),
        ({"name": "p", "memory": "1" * 17}, "memory must be a Kubernetes quantity"),
        ({"name": "p", "cpu": "1\n"}, "cpu must be a Kubernetes quantity"),
        ({"name": "p", "cpu": "0"}, "cpu must be a Kubernetes quantity"),
        ({"name": "p", "memory": "0Gi"}, "memory must be a Kubernetes quantity"),
    ],
)
def test_bad_pool_input_is_a_422_naming_it_and_changes_nothing(
    client, tenant, write_key, body, detail
):
    res = post(client, "", write_key, body)
    assert res.status_code == 422, res.content
    assert detail in res.json()["detail"]
    assert not AgentPool.objects.filter(tenant=tenant).exclude(name="default").exists()


def test_a_duplicate_name_is_a_409(client, tenant, write_key):
    gpu_pool(client, write_key)
    res = post(client, "", write_key, {"name": "gpu"})
    assert res.status_code == 409 and res.json()["detail"] == "pool 'gpu' already exists"
    res = post(client, "", write_key, {"name": "default"})
    assert res.status_code == 409


def test_unknown_pools_are_404(client, tenant, write_key, read_key):
    assert client.get("/api/v1/fleet/pools/nope", **bearer(read_key)).status_code == 404
    for path in ("/nope/provision", "/nope/deprovision"):
        res = post(client, path, write_key)
        assert res.status_code == 404 and res.json()["detail"] == "unknown pool 'nope'"
    assert patch(client, "/nope", write_key, {"gpu": 1}).status_code == 404
    assert client.delete("/api/v1/fleet/pools/nope", **bearer(write_key)).status_code == 404


def test_another_tenants_pool_is_not_found(
    client, tenant, other_tenant, write_key, other_write_key
):
    gpu_pool(client, other_write_key)
    assert client.get("/api/v1/fleet/pools/gpu", **bearer(write_key)).status_code == 404
    assert post(client, "/gpu/provision", write_key).status_code == 404
    assert client.delete("/api/v1/fleet/pools/gpu", **bearer(write_key)).status_code == 404
    assert AgentPool.objects.get(tenant=other_tenant, name="gpu").desired_count == 0
    names = [
        p["name"] for p in client.get("/api/v1/fleet/pools", **bearer(write_key)).json()["pools"]
    ]
    assert names == ["default"]


def test_the_default_pool_cannot_be_deleted(client, tenant, write_key):
    res = client.delete("/api/v1/fleet/pools/default", **bearer(write_key))
    assert res.status_code == 409
    assert res.json()["detail"] == "the default pool cannot be deleted"


def test_deleting_a_pool_gives_its_agents_back(client, tenant, write_key):
    gpu_pool(client, write_key)
    post(client, "/gpu/provision", write_key)
    post(client, "/gpu/provision", write_key)
    res = client.delete("/api/v1/fleet/pools/gpu", **bearer(write_key))
    assert res.status_code == 204
    tenant.refresh_from_db()
    assert tenant.desired_count == 0  # not handed to the default pool
    assert pool_counts(tenant) == {"default": 0}


@pytest.mark.parametrize("role_fixture", ["read_key", "agent_key"])
def test_only_write_keys_change_pools(client, tenant, role_fixture, request):
    key = request.getfixturevalue(role_fixture)
    assert post(client, "", key, {"name": "gpu"}).status_code == 403
    assert post(client, "/default/provision", key).status_code == 403


# -- the limit and clamps --------------------------------------------------------------


def test_a_lowered_limit_shrinks_the_default_pool_first_then_the_newest_pool(tenant):
    for name in ("older", "newer"):
        pools.create_pool(tenant, "t", name, {})
    limits.provision(tenant, "t")
    pools.provision_pool(tenant, "older", "t")
    pools.provision_pool(tenant, "newer", "t")
    pools.provision_pool(tenant, "newer", "t")
    assert pool_counts(tenant) == {"default": 1, "older": 1, "newer": 2}
    limits.set_fleet_overrides(tenant, "root", max_agents_override=2)
    # 4 → 2: the default gives up its one, then the newest pool one of its two.
    assert pool_counts(tenant) == {"default": 0, "older": 1, "newer": 1}
    limits.set_fleet_overrides(tenant, "root", max_agents_override=0)
    assert pool_counts(tenant) == {"default": 0, "older": 0, "newer": 0}
    rows = list(
        FleetChange.objects.filter(tenant=tenant, reason=ChangeReason.CLAMP)
        .order_by("id")
        .values_list("field", "old_value", "new_value", "actor")
    )
    assert rows == [
        ("desired_count", 4, 2, "root"),
        ("pool:newer", 2, 1, "root"),
        ("desired_count", 2, 0, "root"),
        ("pool:newer", 1, 0, "root"),
        ("pool:older", 1, 0, "root"),
    ]


def test_a_lowered_platform_default_clamps_pools_at_boot(tenant, monkeypatch):
    pools.create_pool(tenant, "t", "gpu", {})
    for _ in range(3):
        pools.provision_pool(tenant, "gpu", "t")
    monkeypatch.setenv("CLOACINA_DEFAULT_MAX_AGENTS", "1")
    reset_config()
    try:
        changes = limits.clamp_to_limits()
        assert [(c.field, c.old_value, c.new_value, c.actor) for c in changes] == [
            ("desired_count", 3, 1, "system"),
            ("pool:gpu", 3, 1, "system"),
        ]
        assert pool_counts(tenant) == {"default": 0, "gpu": 1}
        assert limits.clamp_to_limits() == []  # within the limit: nothing, no audit row
    finally:
        monkeypatch.undo()
        reset_config()


def test_the_reconciler_asks_each_pool_for_its_count_with_its_labels(tenant):
    pools.create_pool(tenant, "t", "gpu", {"tags": ["gpu"], "max_concurrency": 1, "gpu": 1})
    limits.provision(tenant, "t")
    pools.provision_pool(tenant, "gpu", "t")
    tenant.refresh_from_db()
    default, gpu = desired_pools(tenant, get_config().default_max_agents)
    assert (default.name, default.desired, default.tags) == ("default", 1, ())
    assert (gpu.name, gpu.desired, gpu.tags, gpu.gpu) == ("gpu", 1, ("gpu", "pool:gpu"), 1)
    assert gpu.runagent_args(4) == ["--max-concurrency", "1", "--tags", "gpu,pool:gpu"]


@pytest.mark.django_db(transaction=True)
def test_concurrent_pool_provisions_never_exceed_the_limit():
    tenant = Tenant.objects.create(name="race", max_agents_override=6)
    pools.create_pool(tenant, "t", "a", {})
    pools.create_pool(tenant, "t", "b", {})
    barrier = threading.Barrier(8)

    def grab(name: str) -> list[bool]:
        barrier.wait()
        granted = []
        try:
            for _ in range(2):
                try:
                    pools.provision_pool(Tenant.objects.get(pk=tenant.pk), name, "t")
                    granted.append(True)
                except pools.FleetLimitError:
                    granted.append(False)
        finally:
            connection.close()
        return granted

    with ThreadPoolExecutor(8) as workers:
        results = [g for batch in workers.map(grab, ["a", "b"] * 4) for g in batch]
    assert results.count(True) == 6 and results.count(False) == 10
    tenant.refresh_from_db()
    counts = pool_counts(tenant)
    assert counts["a"] + counts["b"] == 6 and counts["default"] == 0
    assert tenant.desired_count == 6


# -- the autoscaler, per pool ----------------------------------------------------------


def autoscale_config(**env):
    base = {"CLOACINA_HOME": "/tmp/cloacina-pools-test", "CLOACINA_AUTOSCALE_COOLDOWN_S": "60"}
    return load_config({**base, **{k: str(v) for k, v in env.items()}})


def test_the_autoscaler_scales_the_pool_whose_agents_could_run_the_backlog(tenant, with_actuator):
    pools.create_pool(tenant, "t", "gpu", {"tags": ["gpu"]})
    # A CPU agent with room to spare, and GPU work it cannot take.
    Tenant.objects.filter(pk=tenant.pk).update(desired_count=1)
    agent(tenant, "cpu-1", max_concurrency=4, in_flight=2)  # half busy: the default holds
    routed_package(tenant, tags=["gpu"])
    place_root(tenant)  # Ready, waiting (see the wait test below)
    later = timezone.now() + timedelta(hours=1)  # past every cooldown
    rows = {row.pool: row for row in autoscale_tick(autoscale_config(), later)}
    assert rows["gpu"].decision == UP and rows["gpu"].backlog == 1
    assert rows["default"].decision == HOLD and rows["default"].backlog == 0
    assert pool_counts(tenant) == {"default": 1, "gpu": 1}
    assert AutoscaleDecision.objects.filter(tenant=tenant, pool="gpu", decision=UP).count() == 1
    change = FleetChange.objects.filter(tenant=tenant, field="pool:gpu").latest("id")
    assert (change.old_value, change.new_value, change.reason) == (0, 1, ChangeReason.AUTOSCALER)


def test_the_autoscaler_waits_for_a_pools_agents_before_asking_again(tenant):
    pools.create_pool(tenant, "t", "gpu", {"tags": ["gpu"]})
    routed_package(tenant, tags=["gpu"])
    place_root(tenant)
    t0 = timezone.now() + timedelta(hours=1)
    autoscale_tick(autoscale_config(), t0)
    rows = {r.pool: r for r in autoscale_tick(autoscale_config(), t0 + timedelta(hours=1))}
    assert rows["gpu"].decision == HOLD and "not live yet" in rows["gpu"].reason
    make_agent(tenant, "gpu-1", tags=["gpu", "pool:gpu"], max_concurrency=1, in_flight=1)
    rows = {r.pool: r for r in autoscale_tick(autoscale_config(), t0 + timedelta(hours=2))}
    assert rows["gpu"].decision == UP  # its one agent is live and full; work still waits
    assert pool_counts(tenant)["gpu"] == 2


def test_a_pool_scales_up_only_to_its_share_of_the_limit(tenant):
    pools.create_pool(tenant, "t", "gpu", {"tags": ["gpu"]})
    Tenant.objects.filter(pk=tenant.pk).update(max_agents_override=1, desired_count=1)
    routed_package(tenant, tags=["gpu"])
    place_root(tenant)
    rows = {
        r.pool: r for r in autoscale_tick(autoscale_config(), timezone.now() + timedelta(hours=1))
    }
    assert rows["gpu"].decision == HOLD and "at the effective limit (0)" in rows["gpu"].reason
    assert pool_counts(tenant) == {"default": 1, "gpu": 0}


# -- waiting for a pool instead of failing ---------------------------------------------


def test_gpu_work_waits_for_a_gpu_pool_that_can_grow(tenant, with_actuator):
    pools.create_pool(tenant, "t", "gpu", {"tags": ["gpu"]})
    agent(tenant, "cpu-1")
    routed_package(tenant, tags=["gpu"], retries=0)
    result, task = place_root(tenant)
    assert isinstance(result, NoAgent), result
    assert (task.status, task.error_type) == ("Ready", "")
    assert task.wait_reason.startswith("NoFreeAgent: no live agent matches tags [gpu]; pool 'gpu'")
    assert "can be scaled up" in task.wait_reason


def test_work_waits_while_its_pools_agents_are_starting(tenant):
    # No actuator: only a count someone asked for (and runs agents for) is worth a wait.
    pools.create_pool(tenant, "t", "gpu", {"tags": ["gpu"]})
    pools.provision_pool(tenant, "gpu", "t")
    agent(tenant, "cpu-1")
    routed_package(tenant, tags=["gpu"])
    result, task = place_root(tenant)
    assert isinstance(result, NoAgent), result
    assert "1 of its 1 agent(s) are not live yet" in task.wait_reason


def test_work_no_pool_could_run_still_fails(tenant, with_actuator):
    pools.create_pool(tenant, "t", "gpu", {"tags": ["gpu"]})
    agent(tenant, "cpu-1")
    routed_package(tenant, tags=["tpu"])
    result, task = place_root(tenant)
    assert isinstance(result, Unroutable), result
    assert task.error_type == "NoMatchingAgent"


def test_work_fails_when_its_pool_is_at_the_limit_with_nothing_starting(tenant, with_actuator):
    pools.create_pool(tenant, "t", "gpu", {"tags": ["gpu"]})
    Tenant.objects.filter(pk=tenant.pk).update(max_agents_override=1, desired_count=1)
    agent(tenant, "cpu-1")
    routed_package(tenant, tags=["gpu"])
    result, task = place_root(tenant)
    assert isinstance(result, Unroutable), result
    assert task.error_type == "NoMatchingAgent"


def test_without_an_actuator_an_idle_pool_does_not_hold_work(tenant):
    pools.create_pool(tenant, "t", "gpu", {"tags": ["gpu"]})
    agent(tenant, "cpu-1")
    routed_package(tenant, tags=["gpu"])
    result, task = place_root(tenant)
    assert isinstance(result, Unroutable) and task.error_type == "NoMatchingAgent"


@pytest.mark.parametrize(
    ("value", "status", "stored"), [(2.0, 200, 2), (True, 422, 0), ("2", 422, 0), (2.5, 422, 0)]
)
def test_numbers_are_json_numbers(client, tenant, write_key, value, status, stored):
    gpu_pool(client, write_key, gpu=0)
    res = patch(client, "/gpu", write_key, {"gpu": value})
    assert res.status_code == status, res.content
    assert AgentPool.objects.get(tenant=tenant, name="gpu").gpu == stored


def test_a_reason_given_lands_in_the_audit_note(client, tenant, write_key):
    res = post(client, "", write_key, {"name": "gpu", "reason": "new GPU nodes"})
    assert res.status_code == 201, res.content
    res = post(client, "/gpu/provision", write_key, {"reason": "training run"})
    assert res.status_code == 200, res.content
    notes = dict(
        FleetChange.objects.filter(tenant=tenant, field="pool:gpu").values_list("new_value", "note")
    )
    assert notes == {0: "pool created; new GPU nodes", 1: "training run"}
    res = post(client, "/gpu/deprovision", write_key, {"reason": "x" * 1000})
    assert res.status_code == 422
    assert AgentPool.objects.get(tenant=tenant, name="gpu").desired_count == 1
