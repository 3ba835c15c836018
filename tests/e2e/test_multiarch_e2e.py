"""Multi-architecture dispatch end to end: real `serve --default-executor fleet` and real
agents, one of them declaring `--target-triple aarch64-unknown-linux-gnu` to stand in
for an Arm node on this x86_64 machine."""

from __future__ import annotations

import httpx
import pytest

from agents.protocol.triples import host_triple
from artifacts.models import PackageArtifact, WorkflowPackage
from artifacts.store.testing import build_archive, manifest_toml
from fleet.models import DeliveryOutbox
from tests.support.keys import cli_agent_key, cli_tenant_key
from tests.support.processes import Processes, fleet_serve, start_agent
from tests.support.server_api import execution, start, upload, wait_terminal
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

ARM = "aarch64-unknown-linux-gnu"
SOURCE = "def where(context):\n    return {'ran': context.get('n', 0)}\n"


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


def package(name: str, kind: str, extra: dict | None = None) -> bytes:
    tasks = [{"id": "where", "function": "arch.steps:where"}]
    files = {
        "cloacina.toml": manifest_toml(tasks, name=name, workflow=name, kind=kind),
        "workflow/arch/__init__.py": "",
        "workflow/arch/steps.py": SOURCE,
        **(extra or {}),
    }
    return build_archive(files)


def task_of(server, key: str, execution_id: str) -> dict:
    return execution(server, key, execution_id)["tasks"][0]


def test_native_builds_run_only_where_they_can_load_and_python_anywhere(procs):
    key = cli_tenant_key(procs)
    akey = cli_agent_key(procs)
    server = fleet_serve(procs)
    upload(server, key, package("nat", "native"))
    upload(server, key, package("py", "python"))
    arm = start_agent(procs, server, akey, "arm", "--target-triple", ARM)

    # A native package with only its host build waits: no live agent can load it,
    # and the API says which triples could.
    waiting = start(server, key, "nat", {"n": 1})
    # (Between the reservation's commit and the statement that explains it, the reason
    # is the placeholder "no free agent slot": wait for the explanation itself.)
    reasons: list[str] = []

    def explained() -> bool:
        reasons.append(task_of(server, key, waiting)["wait_reason"])
        return host_triple() in reasons[-1]

    wait_until(
        explained, 20, "a wait reason naming the host triple", logs=lambda: str(reasons[-3:])
    )
    assert task_of(server, key, waiting)["status"] == "Ready"

    # A python package is architecture-independent: it runs on the aarch64 agent,
    # stamped with that agent's own triple.
    done = wait_terminal(server, key, start(server, key, "py", {"n": 2}), timeout=30)
    assert (done["status"], done["tasks"][0]["agent"]) == ("Completed", "arm")
    py_packet = DeliveryOutbox.objects.get(task_execution__workflow_execution_id=done["id"])
    assert py_packet.payload["target_triple"] == ARM

    # Uploading an aarch64 build lets the waiting task run on the Arm agent, with that digest.
    arm_build = package("nat", "native", {"vendor/arch_native.txt": "aarch64 build"})
    response = httpx.post(
        server.api("/packages/nat/1.0.0/artifacts"),
        headers={"Authorization": f"Bearer {key}"},
        files={"file": ("nat-aarch64.tar.gz", arm_build)},
        data={"target_triple": ARM},
        timeout=30,
    )
    assert response.status_code == 201, response.text
    arm_digest = response.json()["digest"]
    finished = wait_terminal(server, key, waiting, timeout=30)
    assert (finished["status"], finished["tasks"][0]["agent"]) == ("Completed", "arm")
    packet = DeliveryOutbox.objects.filter(task_execution__workflow_execution_id=waiting).get()
    assert (packet.payload["artifact_digest"], packet.payload["target_triple"]) == (arm_digest, ARM)

    # A host-triple agent takes the primary build; the Arm agent is gone.
    arm.stop()
    start_agent(procs, server, akey, "x86")
    host_run = wait_terminal(server, key, start(server, key, "nat", {"n": 3}), timeout=30)
    assert (host_run["status"], host_run["tasks"][0]["agent"]) == ("Completed", "x86")
    primary = WorkflowPackage.objects.get(name="nat")
    host_packet = DeliveryOutbox.objects.get(task_execution__workflow_execution_id=host_run["id"])
    assert host_packet.payload["artifact_digest"] == primary.digest
    assert host_packet.payload["target_triple"] == primary.host_triple == host_triple()
    assert PackageArtifact.objects.filter(package=primary, target_triple=ARM).count() == 1


def test_work_packets_travel_as_messagepack_when_the_server_says_so(procs):
    key = cli_tenant_key(procs)
    akey = cli_agent_key(procs)
    server = fleet_serve(procs, CLOACINA_WIRE_FORMAT="msgpack")
    upload(server, key, package("py", "python"))
    start_agent(procs, server, akey, "packed", env=procs.env(CLOACINA_WIRE_FORMAT="msgpack"))
    done = wait_terminal(server, key, start(server, key, "py", {"n": 7}), timeout=30)
    assert done["status"] == "Completed" and done["context"]["ran"] == 7
    from agents.models import Agent

    assert Agent.objects.get(name="packed").wire_format == "msgpack"
