"""Tenant isolation matrix: every URL of the URL conf, and the WebSocket route.

The URL conf is walked (the API's operations, the console, the admin, the
plain views) and every URL name must have a case in :data:`CASES`; the
WebSocket routes must have one in :data:`SOCKET_CASES`.  A new endpoint
without a case fails :func:`test_every_endpoint_has_a_case`.

Each case acts as tenant A (acme: a key of the role the endpoint wants, or a
console user with write access to acme) on tenant B's objects (globex: a
package, an execution, an agent, a work packet, an eviction) and checks that
A gets 403/404 with exactly the answer a nonexistent object gets (the ids
themselves aside), that B's objects are unchanged, and that list pages and
documents carry nothing of B.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils import timezone

pytestmark = pytest.mark.django_db(transaction=True)

GLOBEX_AGENT = "globex-secret-agent"
GLOBEX_LOG = "globex-secret-log-line"
MISSING_DIGEST = "0" * 64


# -- the world: tenant A's callers, tenant B's objects ------------------------------------


@dataclass
class World:
    a: object
    b: object
    keys: dict[str, str]  # A's keys by role
    a_agent: object
    a_user: object
    b_package: object
    b_execution: object
    b_agent: object
    b_outbox: object
    missing: dict = field(default_factory=dict)
    b_snapshot: dict = field(default_factory=dict)
    b_build: object = None
    b_pool: object = None
    b_schedule: object = None

    def api(self, role: str) -> Client:
        return Client(HTTP_AUTHORIZATION=f"Bearer {self.keys[role]}")

    def console(self) -> Client:
        client = Client()
        client.force_login(self.a_user)
        return client

    def secrets(self) -> list[str]:
        """Strings only B's data contains: none may reach A."""
        return [
            self.b.name,
            self.b_package.digest,
            str(self.b_execution.pk),
            str(self.b_agent.pk),
            str(self.b_build.pk),
            str(self.b_schedule.pk),
            GLOBEX_AGENT,
            GLOBEX_LOG,
        ]


@pytest.fixture
def world(transactional_db) -> World:
    from django.contrib.auth import get_user_model

    from agents.protocol.triples import host_triple
    from artifacts.models import BuildJob
    from artifacts.store.services import publish_package
    from artifacts.store.testing import build_archive, example_files
    from fleet.engine.claims import claim_task
    from fleet.executors.fleet import roster
    from fleet.models import (
        AgentPool,
        ApiKey,
        DeliveryOutbox,
        Eviction,
        TaskAttemptLog,
        TaskExecution,
        TenantMembership,
    )
    from fleet.schedules.service import ScheduleSpec, create_schedule
    from tests.support.agents import make_agent
    from tests.support.factories import make_tenant, start

    a, b = make_tenant("acme"), make_tenant("globex")
    keys = {role: ApiKey.mint(role, tenant=a)[1] for role in ("agent", "read", "write")}
    a_agent = roster.register(
        ApiKey.verify(keys["agent"]),
        roster.Registration(name="acme-1", target_triple=host_triple()),
    )
    # B's package differs from anything A uploads, so its digest is B's alone.
    b_files = {**example_files(), "workflow/globex_only.py": "MARK = 'globex'\n"}
    b_package, _ = publish_package(b, build_archive(b_files))
    b_execution, b_tasks = start(b, b_package.workflow_name, {"owner": "globex"})
    b_agent = make_agent(b, name=GLOBEX_AGENT)
    claim = claim_task(b_tasks["extract"].pk, "matrix")
    b_outbox = DeliveryOutbox.objects.create(
        pk=1_234_567, tenant=b, agent=b_agent, task_execution_id=b_tasks["extract"].pk,
        assignment=claim.assignment, payload={"task": "extract"},
    )  # fmt: skip
    TaskExecution.objects.filter(pk=b_tasks["extract"].pk).update(agent=b_agent)
    # What B's running task printed so far: a log no caller of A may read or extend.
    TaskAttemptLog.objects.create(
        task_execution_id=b_tasks["extract"].pk, attempt=claim.attempt,
        assignment=claim.assignment, text=f"{GLOBEX_LOG}\n", bytes=len(GLOBEX_LOG) + 1,
    )  # fmt: skip
    Eviction.objects.create(
        agent=b_agent, tenant=b, agent_name=GLOBEX_AGENT, reason="matrix",
        last_heartbeat=timezone.now() - timedelta(minutes=1),
    )  # fmt: skip
    user = get_user_model().objects.create_user("alice", "alice@example.com", None)
    TenantMembership.objects.create(user=user, tenant=a, role="write")
    world = World(
        a, b, keys, a_agent, user, b_package, b_execution, b_agent, b_outbox,
        missing={
            "tenant": "no-such-tenant",
            "package": "no-such-package",
            "workflow": "no-such-workflow",
            "execution": str(uuid.uuid4()),
            "agent": str(uuid.uuid4()),
            "digest": MISSING_DIGEST,
            "outbox": 2_000_000_000,
            "task": str(uuid.uuid4()),
            "build": str(uuid.uuid4()),
            "pool": "no-such-pool",
            "schedule": str(uuid.uuid4()),
        },
    )  # fmt: skip
    # B's GPU pool: A may have a pool of the same name, and never sees or moves B's.
    world.b_pool = AgentPool.objects.create(tenant=b, name="gpu", tags=["gpu"], desired_count=0)
    world.b_build = BuildJob.objects.create(
        id=uuid.uuid4(), tenant=b, package=b_package, package_name=b_package.name,
        version=b_package.version, target_triple="aarch64-unknown-linux-gnu", state="failed",
        detail="globex build detail", error_kind="invalid",
    )  # fmt: skip
    world.b_schedule = create_schedule(
        b, ScheduleSpec(b_package.workflow_name, "*/5 * * * *", context={"owner": "globex"})
    )
    world.b_snapshot = snapshot_of_b(world)
    return world


# -- the checks --------------------------------------------------------------------------


CSRF_TOKEN = re.compile(r'(X-CSRFToken": "|name="csrfmiddlewaretoken" value=")[^"]+')


def _text(response, values: list) -> str:
    """The body, with ``values`` (whole tokens) and per-request CSRF tokens blanked out."""
    text = b"".join(response.streaming_content if response.streaming else [response.content])
    text = CSRF_TOKEN.sub(r"\1<csrf>", text.decode(errors="replace"))
    for value in sorted(map(str, values), key=len, reverse=True):
        text = re.sub(rf"(?<![\w-]){re.escape(value)}(?![\w-])", "<id>", text)
    return text


def same_as_missing(of_b, of_missing, b_values: list, missing_values: list) -> None:
    """B's object is refused exactly like a nonexistent one: 403/404, the same body."""
    assert of_b.status_code in (403, 404), (of_b.status_code, of_b.content[:300])
    assert of_b.status_code == of_missing.status_code, (of_b.content, of_missing.content)
    assert _text(of_b, b_values) == _text(of_missing, missing_values)


def nothing_of_b(response, world: World) -> None:
    text = _text(response, [])
    leaked = [s for s in world.secrets() if s in text]
    assert not leaked, f"{response.request['PATH_INFO']} shows B's {leaked}"


def snapshot_of_b(world: World) -> dict:
    """Everything of B an endpoint could change."""
    from agents.models import Agent
    from artifacts.models import BuildJob, WorkflowPackage
    from fleet.models import (
        AgentPool,
        DeliveryOutbox,
        ExecutionLink,
        Schedule,
        ScheduleFire,
        TaskAttemptLog,
        TaskExecution,
        Tenant,
        WorkflowExecution,
    )

    b = world.b.pk
    return {
        "pools": list(AgentPool.objects.filter(tenant=b).order_by("id").values()),
        "tenant": list(Tenant.objects.filter(pk=b).values()),
        "packages": list(WorkflowPackage.objects.filter(tenant=b).values()),
        "executions": list(WorkflowExecution.objects.filter(tenant=b).values()),
        "tasks": list(TaskExecution.objects.filter(tenant=b).order_by("id").values()),
        "agents": list(Agent.objects.filter(tenant=b).order_by("id").values()),
        "outbox": list(DeliveryOutbox.objects.filter(tenant=b).values()),
        "builds": list(BuildJob.objects.filter(tenant=b).values()),
        "schedules": list(Schedule.objects.filter(tenant=b).values()),
        "fires": list(ScheduleFire.objects.filter(schedule__tenant=b).values()),
        "links": list(ExecutionLink.objects.filter(tenant=b).order_by("id").values()),
        "logs": list(
            TaskAttemptLog.objects.filter(task_execution__tenant=b).order_by("id").values()
        ),
    }


def b_unchanged(world: World) -> None:
    assert snapshot_of_b(world) == world.b_snapshot


def _post_json(client: Client, url: str, body: dict):
    return client.post(url, body, content_type="application/json")


# -- API cases ---------------------------------------------------------------------------

API = "/api/v1"


def _refused_like_missing(role: str, method: str, template: str, body=None, multipart=False):
    """A case for an endpoint addressed by B's object in the URL."""

    def case(world: World) -> None:
        b_values = {
            "tenant": world.b.name,
            "package": world.b_package.name,
            "version": world.b_package.version,
            "workflow": world.b_package.workflow_name,
            "execution": world.b_execution.pk,
            "agent": world.b_agent.pk,
            "digest": world.b_package.digest,
            "build": world.b_build.pk,
            "pool": world.b_pool.name,
            "schedule": world.b_schedule.pk,
        }
        missing = {**world.missing, "version": "9.9.9"}
        client = world.api(role)
        answers = []
        for values in (b_values, missing):
            url = API + template.format(**values)
            if method == "GET":
                answers.append(client.get(url))
            elif multipart:
                answers.append(client.post(url, body(world)))
            else:
                answers.append(
                    client.generic(method, url, _json(body(world) if body else {}),
                                   content_type="application/json")
                )  # fmt: skip
        used = [k for k in b_values if "{" + k + "}" in template]
        same_as_missing(*answers, [b_values[k] for k in used], [missing[k] for k in used])
        b_unchanged(world)

    return case


def _json(body: dict) -> str:
    return json.dumps(body)


def _lists_nothing_of_b(role: str, method: str, url: str, body=None):
    """A case for an endpoint of the caller's own tenant: B shows nowhere, B is unchanged."""

    def case(world: World) -> None:
        client = world.api(role)
        if method == "GET":
            response = client.get(API + url)
        else:
            response = _post_json(client, API + url, body or {})
        assert response.status_code < 500, response.content
        nothing_of_b(response, world)
        b_unchanged(world)

    return case


def _artifact_upload(world: World) -> dict:
    from django.core.files.uploadedfile import SimpleUploadedFile

    from artifacts.store.testing import example_archive

    return {
        "file": SimpleUploadedFile("build.tar.gz", example_archive()),
        "target_triple": "aarch64-unknown-linux-gnu",
    }


def upload_under_bs_name(world: World) -> None:
    """A package of B's name and version is A's own: no conflict, no sign that B has it."""
    from django.core.files.uploadedfile import SimpleUploadedFile

    from artifacts.store.testing import example_archive

    response = world.api("write").post(
        f"{API}/packages", {"file": SimpleUploadedFile("p.tar.gz", example_archive())}
    )
    assert response.status_code == 201, response.content
    assert response.json()["name"] == world.b_package.name
    nothing_of_b(response, world)
    b_unchanged(world)


def register_under_bs_agent_name(world: World) -> None:
    """An agent of A named like B's does not replace (or reveal) B's."""
    from agents.protocol.triples import host_triple

    body = {"name": GLOBEX_AGENT, "target_triple": host_triple(), "protocol_version": 1}
    response = _post_json(world.api("agent"), f"{API}/agents/register", body)
    assert response.status_code == 201, response.content
    assert response.json()["agent_id"] != str(world.b_agent.pk)
    b_unchanged(world)


def result_for_bs_packet(world: World) -> None:
    """A's agent reporting an outcome for B's work packet: refused like an unknown packet."""
    client = world.api("agent")
    url = f"{API}/agents/{world.a_agent.pk}/results"
    packet = world.b_outbox

    def report(outbox_id, task_id):
        body = {"outbox_id": outbox_id, "task_execution_id": str(task_id), "assignment": 1,
                "outcome": "success", "output": {"stolen": True}}  # fmt: skip
        return _post_json(client, url, body)

    of_b = report(packet.pk, packet.task_execution_id)
    missing = report(world.missing["outbox"], world.missing["task"])
    same_as_missing(
        of_b,
        missing,
        [packet.pk, packet.task_execution_id],
        [world.missing["outbox"], world.missing["task"]],
    )
    b_unchanged(world)


def context_of_bs_task(world: World) -> None:
    """A's agent asking for the input context of B's task (by A's agent id or B's):
    refused like an unknown task or agent (docs/routing.md, large contexts)."""
    client = world.api("agent")
    b_task, missing_task = world.b_outbox.task_execution_id, world.missing["task"]
    for agent_id, missing_agent in ((world.a_agent.pk, world.a_agent.pk),
                                    (world.b_agent.pk, world.missing["agent"])):  # fmt: skip
        answers = [
            client.get(f"{API}/agents/{a}/tasks/{t}/context?assignment=1")
            for a, t in ((agent_id, b_task), (missing_agent, missing_task))
        ]
        same_as_missing(*answers, [agent_id, b_task], [missing_agent, missing_task])
    b_unchanged(world)


def console_drain_bs_agent(world: World) -> None:
    """A's console writer draining B's agent, under B's tenant name or A's own."""
    client = world.console()
    for name, missing_name in (
        (world.b.name, world.missing["tenant"]),
        (world.a.name, world.a.name),
    ):
        answers = [
            client.post(f"/console/tenants/{n}/agents/{a}/drain/", HTTP_HX_REQUEST="true")
            for n, a in ((name, world.b_agent.pk), (missing_name, world.missing["agent"]))
        ]
        same_as_missing(*answers, [name, world.b_agent.pk], [missing_name, world.missing["agent"]])
    b_unchanged(world)


def public_document(path: str):
    def case(world: World) -> None:
        response = Client().get(path)
        assert response.status_code == 200
        nothing_of_b(response, world)

    return case


def metrics_names_tenants_only(world: World) -> None:
    """An operator endpoint (no key; see docs/threat-model.md): tenant names and counts,
    never an object of a tenant."""
    response = Client().get("/metrics")
    assert response.status_code == 200
    text = response.content.decode()
    for secret in world.secrets()[1:]:
        assert secret not in text


def health_says_nothing(world: World) -> None:
    response = Client().get("/healthz")
    assert response.status_code == 200
    nothing_of_b(response, world)


def static_file_is_no_data(world: World) -> None:
    assert Client().get("/static/htmx.min.js").status_code == 200
    for path in ("/static/../cloacina_site/settings.py", "/static/%2e%2e/manage.py"):
        assert Client().get(path).status_code == 404


# -- console cases -----------------------------------------------------------------------


def console_list(url: str):
    def case(world: World) -> None:
        client = world.console()
        response = client.get(url)
        assert response.status_code == 200, response.content[:300]
        nothing_of_b(response, world)
        if url.endswith(("evictions/", "outbox/", "executions/", "table/", "depth/")):
            filtered = client.get(url, {"tenant": world.b.name})
            missing = client.get(url, {"tenant": world.missing["tenant"]})
            same_as_missing(filtered, missing, [world.b.name], [world.missing["tenant"]])

    return case


def console_tenant(template: str, method: str = "GET"):
    def case(world: World) -> None:
        from fleet.console.tenants import PARTIALS

        client = world.console()
        parts = sorted(PARTIALS) if "{part}" in template else [""]
        for part in parts:
            answers = [
                getattr(client, method.lower())(
                    template.format(name=name, part=part),
                    {"desired_count": "3"} if method == "POST" else {},
                    HTTP_HX_REQUEST="true",
                )  # fmt: skip
                for name in (world.b.name, world.missing["tenant"])
            ]
            same_as_missing(*answers, [world.b.name], [world.missing["tenant"]])
        b_unchanged(world)

    return case


def console_pool(action: str):
    """A's console writer acting on B's pool: under B's tenant name, or under A's own name
    with B's pool name — refused (or not found) exactly like a pool that does not exist."""

    def case(world: World) -> None:
        client = world.console()
        missing_tenant, missing_pool = world.missing["tenant"], world.missing["pool"]
        pool = world.b_pool.name
        for (name, p), (m_name, m_pool) in (
            ((world.b.name, pool), (missing_tenant, missing_pool)),
            ((world.a.name, pool), (world.a.name, missing_pool)),
        ):
            answers = [
                client.post(f"/console/tenants/{n}/pools/{q}/{action}/", HTTP_HX_REQUEST="true")
                for n, q in ((name, p), (m_name, m_pool))
            ]
            same_as_missing(*answers, [name, p], [m_name, m_pool])
        b_unchanged(world)

    return case


def console_schedule(template: str, method: str = "POST"):
    """B's schedule through B's tenant name, and through A's own: refused like a missing one."""

    def case(world: World) -> None:
        client = world.console()
        b_id, missing_id = world.b_schedule.pk, world.missing["schedule"]
        for own, other in ((world.b.name, world.missing["tenant"]), (world.a.name, world.a.name)):
            answers = [
                getattr(client, method.lower())(
                    template.format(name=name, id=i), HTTP_HX_REQUEST="true"
                )
                for name, i in ((own, b_id), (other, missing_id))
            ]
            same_as_missing(*answers, [b_id, world.b.name], [missing_id, world.missing["tenant"]])
        b_unchanged(world)

    return case


def console_create_pool(world: World) -> None:
    """A's writer creates a pool named like B's: its own, B's unchanged; B's tenant: 404."""
    client = world.console()
    answers = [
        client.post(f"/console/tenants/{n}/pools/", {"name": "x"}, HTTP_HX_REQUEST="true")
        for n in (world.b.name, world.missing["tenant"])
    ]
    same_as_missing(*answers, [world.b.name], [world.missing["tenant"]])
    response = client.post(
        f"/console/tenants/{world.a.name}/pools/", {"name": world.b_pool.name},
        HTTP_HX_REQUEST="true",
    )  # fmt: skip
    assert response.status_code == 204, response.content
    b_unchanged(world)


def console_execution(template: str, method: str = "GET"):
    def case(world: World) -> None:
        client = world.console()
        ids = (world.b_execution.pk, world.missing["execution"])
        answers = [getattr(client, method.lower())(template.format(id=i)) for i in ids]
        same_as_missing(*answers, [ids[0]], [ids[1]])
        b_unchanged(world)

    return case


def console_login(world: World) -> None:
    response = Client().get("/console/login/")
    assert response.status_code == 200
    nothing_of_b(response, world)


def console_logout(world: World) -> None:
    assert world.console().post("/console/logout/").status_code == 302


CASES: dict[str, Callable[[World], None]] = {
    "api-v1:api-root": public_document("/api/v1/openapi.json"),
    "api-v1:openapi-json": public_document("/api/v1/openapi.json"),
    "api-v1:openapi-view": public_document("/api/v1/docs"),
    "api-v1:upload_package": upload_under_bs_name,
    "api-v1:list_packages": _lists_nothing_of_b("read", "GET", "/packages"),
    "api-v1:upload_target_artifact": _refused_like_missing(
        "write", "POST", "/packages/{package}/{version}/artifacts", _artifact_upload, True
    ),
    "api-v1:build_target_artifact": _refused_like_missing(
        "write",
        "POST",
        "/packages/{package}/{version}/builds",
        lambda w: {"target_triple": "aarch64-unknown-linux-gnu"},
    ),  # fmt: skip
    "api-v1:get_build": _refused_like_missing("read", "GET", "/builds/{build}"),
    "api-v1:download_artifact": _refused_like_missing("agent", "GET", "/artifacts/{digest}"),
    "api-v1:start_execution": _refused_like_missing(
        "write", "POST", "/workflows/{workflow}/executions", lambda w: {"context": {}}
    ),
    "api-v1:list_executions": _lists_nothing_of_b("read", "GET", "/executions?limit=200"),
    "api-v1:get_execution": _refused_like_missing("read", "GET", "/executions/{execution}"),
    "api-v1:cancel_execution": _refused_like_missing(
        "write", "POST", "/executions/{execution}/cancel"
    ),
    "api-v1:rerun_execution": _refused_like_missing(
        "write", "POST", "/executions/{execution}/rerun", lambda w: {"context": {"x": 1}}
    ),
    "api-v1:retry_execution": _refused_like_missing(
        "write", "POST", "/executions/{execution}/retry"
    ),
    "api-v1:task_log": _refused_like_missing(
        "read", "GET", "/executions/{execution}/tasks/extract/logs"
    ),
    "api-v1:create_schedule": _lists_nothing_of_b(
        "write", "POST", "/schedules", {"workflow": "etl-demo", "cron": "* * * * *"}
    ),
    "api-v1:list_schedules": _lists_nothing_of_b("read", "GET", "/schedules"),
    "api-v1:get_schedule": _refused_like_missing("read", "GET", "/schedules/{schedule}"),
    "api-v1:update_schedule": _refused_like_missing(
        "write", "PATCH", "/schedules/{schedule}", lambda w: {"enabled": False}
    ),
    "api-v1:delete_schedule": _refused_like_missing("write", "DELETE", "/schedules/{schedule}"),
    "api-v1:run_schedule": _refused_like_missing("write", "POST", "/schedules/{schedule}/run"),
    "api-v1:list_fires": _refused_like_missing("read", "GET", "/schedules/{schedule}/fires"),
    "api-v1:get_fleet": _lists_nothing_of_b("read", "GET", "/fleet"),
    "api-v1:provision": _lists_nothing_of_b("write", "POST", "/fleet/provision"),
    "api-v1:deprovision": _lists_nothing_of_b("write", "POST", "/fleet/deprovision"),
    "api-v1:fleet_history": _lists_nothing_of_b("read", "GET", "/fleet/history"),
    # A tenant key may not touch any tenant's limits: 403 before the name is looked at.
    "api-v1:admin_set_fleet": _refused_like_missing(
        "write", "PUT", "/admin/tenants/{tenant}/fleet", lambda w: {"desired_count": 3}
    ),
    "api-v1:list_pools": _lists_nothing_of_b("read", "GET", "/fleet/pools"),
    "api-v1:create_pool": _lists_nothing_of_b("write", "POST", "/fleet/pools", {"name": "gpu"}),
    "api-v1:get_pool": _refused_like_missing("read", "GET", "/fleet/pools/{pool}"),
    "api-v1:update_pool": _refused_like_missing(
        "write", "PATCH", "/fleet/pools/{pool}", lambda w: {"gpu": 2}
    ),
    "api-v1:delete_pool": _refused_like_missing("write", "DELETE", "/fleet/pools/{pool}"),
    "api-v1:provision_pool": _refused_like_missing(
        "write", "POST", "/fleet/pools/{pool}/provision"
    ),
    "api-v1:deprovision_pool": _refused_like_missing(
        "write", "POST", "/fleet/pools/{pool}/deprovision"
    ),
    "api-v1:register_agent": register_under_bs_agent_name,
    "api-v1:agent_heartbeat": _refused_like_missing(
        "agent", "POST", "/agents/{agent}/heartbeat", lambda w: {"in_flight": 0}
    ),
    "api-v1:agent_result": result_for_bs_packet,
    "api-v1:deregister_agent": _refused_like_missing("agent", "POST", "/agents/{agent}/deregister"),
    "api-v1:drain_agent": _refused_like_missing("write", "POST", "/agents/{agent}/drain"),
    "api-v1:task_context": context_of_bs_task,
    "console:drain_agent": console_drain_bs_agent,
    "healthz": health_says_nothing,
    "metrics": metrics_names_tenants_only,
    "static": static_file_is_no_data,
    "console:overview": console_list("/console/"),
    "console:overview_rows": console_list("/console/partials/overview/"),
    "console:login": console_login,
    "console:logout": console_logout,
    "console:tenant": console_tenant("/console/tenants/{name}/"),
    "console:tenant_partial": console_tenant("/console/tenants/{name}/partials/{part}/"),
    "console:provision": console_tenant("/console/tenants/{name}/provision/", "POST"),
    "console:deprovision": console_tenant("/console/tenants/{name}/deprovision/", "POST"),
    "console:fleet_overrides": console_tenant("/console/tenants/{name}/fleet-overrides/", "POST"),
    "console:create_pool": console_create_pool,
    "console:provision_pool": console_pool("provision"),
    "console:deprovision_pool": console_pool("deprovision"),
    "console:edit_pool": console_pool("edit"),
    "console:delete_pool": console_pool("delete"),
    "console:schedules": console_tenant("/console/tenants/{name}/schedules/"),
    "console:schedules_table": console_tenant("/console/tenants/{name}/schedules/partials/table/"),
    "console:pause_schedule": console_schedule("/console/tenants/{name}/schedules/{id}/pause/"),
    "console:resume_schedule": console_schedule("/console/tenants/{name}/schedules/{id}/resume/"),
    "console:run_schedule": console_schedule("/console/tenants/{name}/schedules/{id}/run/"),
    "console:evictions": console_list("/console/evictions/"),
    "console:evictions_table": console_list("/console/evictions/partials/table/"),
    "console:outbox": console_list("/console/outbox/"),
    "console:outbox_depth": console_list("/console/outbox/partials/depth/"),
    "console:executions": console_list("/console/executions/"),
    "console:executions_table": console_list("/console/executions/partials/table/"),
    "console:execution": console_execution("/console/executions/{id}/"),
    "console:execution_graph": console_execution("/console/executions/{id}/partials/graph/"),
    "console:cancel_execution": console_execution("/console/executions/{id}/cancel/", "POST"),
    "console:rerun_execution": console_execution("/console/executions/{id}/rerun/", "POST"),
    "console:retry_execution": console_execution("/console/executions/{id}/retry/", "POST"),
    "console:packages": console_tenant("/console/tenants/{name}/packages/"),
    "console:packages_table": console_tenant("/console/tenants/{name}/packages/partials/table/"),
    "console:upload_package": console_tenant("/console/tenants/{name}/packages/upload/", "POST"),
    "console:start_execution": console_tenant("/console/tenants/{name}/executions/start/", "POST"),
    "console:task_log": console_execution("/console/executions/{id}/tasks/extract/log/"),
    "console:task_log_panel": console_execution(
        "/console/executions/{id}/tasks/extract/log/partials/panel/"
    ),
}
# Every admin URL is Django's admin site: staff only (see test_the_admin_site_is_staff_only).
ADMIN_NAMESPACE = "admin:"


def is_admin(name: str, route: str) -> bool:
    return name.startswith(ADMIN_NAMESPACE) or route.startswith("admin/")


# -- enumeration -------------------------------------------------------------------------


def url_names(patterns=None, namespace: str = "", prefix: str = "") -> list[tuple[str, str]]:
    """(name, route) of every URL pattern; an unnamed pattern is named by its route."""
    found = []
    for pattern in get_resolver().url_patterns if patterns is None else patterns:
        route = prefix + str(pattern.pattern)
        if isinstance(pattern, URLResolver):
            inner = f"{namespace}{pattern.namespace}:" if pattern.namespace else namespace
            found += url_names(pattern.url_patterns, inner, route)
        elif isinstance(pattern, URLPattern):
            found.append((f"{namespace}{pattern.name}" if pattern.name else route, route))
    return found


def test_every_endpoint_has_a_case():
    from agents.surface.routing import websocket_urlpatterns

    names = {name for name, route in url_names() if not is_admin(name, route)}
    assert names - set(CASES) == set(), "endpoints without an isolation case"
    assert set(CASES) - names == set(), "cases for endpoints that no longer exist"
    assert {str(p.pattern) for p in websocket_urlpatterns} == set(SOCKET_CASES)
    assert any(is_admin(name, route) for name, route in url_names())


@pytest.mark.parametrize("name", sorted(CASES))
def test_tenant_a_learns_nothing_of_tenant_b(name, world):
    CASES[name](world)


def test_the_admin_site_is_staff_only(world):
    """Every admin URL (B's objects filled in) sends a tenant's console user to the login."""
    from django.contrib.contenttypes.models import ContentType

    client = world.console()
    b_objects = {"tenant": world.b.pk, "workflowexecution": world.b_execution.pk,
                 "agent": world.b_agent.pk, "workflowpackage": world.b_package.pk}  # fmt: skip
    checked = 0
    for name, route in url_names():
        if not is_admin(name, route) or name in ("admin:login", "admin:logout"):
            continue
        parts = route.split("/")
        obj = b_objects.get(parts[2] if len(parts) > 2 else "", world.b.pk)
        url = "/" + route
        url = re.sub(r"<path:object_id>", str(obj), url)
        url = re.sub(
            r"<int:content_type_id>", str(ContentType.objects.get_for_model(world.b).pk), url
        )
        url = re.sub(r"<app_label>|\(\?P<app_label>[^)]*\)", "fleet", url)
        url = url.replace("^", "").replace("$", "")
        response = client.get(url)
        assert response.status_code == 302, (url, response.status_code)
        assert response["Location"].startswith("/admin/login/"), url
        checked += 1
    assert checked > 20


def test_a_console_session_never_authenticates_an_api_call(world):
    client = world.console()
    assert client.get(f"{API}/executions/{world.b_execution.pk}").status_code == 401
    assert client.get(f"{API}/fleet").status_code == 401


# -- the WebSocket -----------------------------------------------------------------------


def socket_of_bs_agent(world: World) -> None:
    """A's agent key on B's agent id: closed exactly like an unknown agent id."""
    from channels.testing import WebsocketCommunicator

    from cloacina_site.asgi import application
    from tests.support.loop import run_async

    async def close_of(agent_id) -> tuple:
        comm = WebsocketCommunicator(
            application, f"/ws/agents/{agent_id}/",
            headers=[(b"authorization", f"Bearer {world.keys['agent']}".encode())],
        )  # fmt: skip
        await comm.connect()
        while True:
            message = await comm.receive_output(3)
            if message["type"] == "websocket.close":
                await comm.disconnect()
                return message.get("code"), message.get("reason")

    of_b = run_async(close_of(world.b_agent.pk))
    missing = run_async(close_of(world.missing["agent"]))
    assert of_b == missing and of_b[0] == 4404, (of_b, missing)
    b_unchanged(world)


def result_frame_for_bs_packet(world: World) -> None:
    """Over A's own socket, a result frame for B's work packet: answered like an unknown
    packet (result_ack 404, same detail), nothing of B changes."""
    from channels.testing import WebsocketCommunicator

    from cloacina_site.asgi import application
    from tests.support.loop import run_async

    async def ack_for(outbox_id, task_id) -> dict:
        comm = WebsocketCommunicator(
            application, f"/ws/agents/{world.a_agent.pk}/",
            headers=[(b"authorization", f"Bearer {world.keys['agent']}".encode())],
        )  # fmt: skip
        connected, _ = await comm.connect()
        assert connected
        await comm.send_json_to({"type": "hello", "holding": []})
        await comm.send_json_to(
            {"type": "result", "outbox_id": outbox_id, "task_execution_id": str(task_id),
             "assignment": 1, "outcome": "success", "output": {"stolen": True}}
        )  # fmt: skip
        while True:
            frame = await comm.receive_json_from(5)
            if frame.get("type") == "result_ack":
                await comm.disconnect()
                return frame

    packet, missing = world.b_outbox, world.missing
    of_b = run_async(ack_for(packet.pk, packet.task_execution_id))
    of_missing = run_async(ack_for(missing["outbox"], missing["task"]))
    assert of_b["status"] == of_missing["status"] == 404, (of_b, of_missing)
    normalise = [(str(packet.pk), "<id>"), (str(packet.task_execution_id), "<id>")]
    text_b = json.dumps({**of_b, "outbox_id": 0})
    for old, new in normalise:
        text_b = text_b.replace(old, new)
    text_missing = json.dumps({**of_missing, "outbox_id": 0})
    for old in (str(missing["outbox"]), str(missing["task"])):
        text_missing = text_missing.replace(old, "<id>")
    assert text_b == text_missing
    b_unchanged(world)


def log_frame_for_bs_task(world: World) -> None:
    """Over A's own socket, a live ``log`` frame for B's running task (its real assignment):
    it extends nothing of B's log."""
    from channels.testing import WebsocketCommunicator

    from cloacina_site.asgi import application
    from tests.support.loop import run_async

    task_id = world.b_outbox.task_execution_id
    assignment = world.b_outbox.assignment

    async def send_log() -> None:
        comm = WebsocketCommunicator(
            application, f"/ws/agents/{world.a_agent.pk}/",
            headers=[(b"authorization", f"Bearer {world.keys['agent']}".encode())],
        )  # fmt: skip
        connected, _ = await comm.connect()
        assert connected
        await comm.send_json_to({"type": "hello", "holding": []})
        await comm.send_json_to(
            {"type": "log", "task_execution_id": str(task_id), "assignment": assignment,
             "text": "acme writes into globex's log\n", "bytes": 10_000, "skipped": 0}
        )  # fmt: skip
        # A result for a missing packet after it: once it is answered, the log frame
        # (handled first, in order) has been too.
        await comm.send_json_to(
            {"type": "result", "outbox_id": world.missing["outbox"],
             "task_execution_id": world.missing["task"], "assignment": 1,
             "outcome": "success", "output": {}}
        )  # fmt: skip
        while (await comm.receive_json_from(5)).get("type") != "result_ack":
            pass
        await comm.disconnect()

    run_async(send_log())
    b_unchanged(world)


def socket_cases(world: World) -> None:
    socket_of_bs_agent(world)
    result_frame_for_bs_packet(world)
    log_frame_for_bs_task(world)


def register_on_the_socket_under_bs_agent_name(world: World) -> None:
    """On the registering socket, an agent of A named like B's: a new agent of A, whose
    answer names nothing of B; B's agent is not replaced."""
    from channels.testing import WebsocketCommunicator

    from agents.protocol.triples import host_triple
    from cloacina_site.asgi import application
    from tests.support.loop import run_async

    async def register() -> dict:
        comm = WebsocketCommunicator(
            application, "/ws/agents/",
            headers=[(b"authorization", f"Bearer {world.keys['agent']}".encode())],
        )  # fmt: skip
        connected, _ = await comm.connect()
        assert connected
        await comm.send_json_to(
            {"type": "register", "name": GLOBEX_AGENT, "target_triple": host_triple(),
             "protocol_version": 1, "wire_format": "json"}
        )  # fmt: skip
        answer = await comm.receive_json_from(5)
        await comm.disconnect()
        return answer

    answer = run_async(register())
    assert answer["type"] == "registered", answer
    assert answer["agent_id"] != str(world.b_agent.pk)
    assert str(world.b_agent.pk) not in json.dumps(answer)
    b_unchanged(world)


SOCKET_CASES = {
    "ws/agents/<str:agent_id>/": socket_cases,
    "ws/agents/": register_on_the_socket_under_bs_agent_name,
}


@pytest.mark.parametrize("route", sorted(SOCKET_CASES))
def test_tenant_a_cannot_open_tenant_bs_socket(route, world):
    SOCKET_CASES[route](world)
