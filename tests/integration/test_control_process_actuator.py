"""The process actuator's bookkeeping with real child processes.

The children here are a small stand-in script with runagent's command line
(it records what it was given and exits on SIGTERM, or refuses to when told),
so drain timeouts and crashes take milliseconds.  The real `runagent` is
driven by tests/e2e/test_control_process_e2e.py.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from agents.models import Agent
from fleet.control.actuators.process import ProcessActuator
from fleet.models import AffinityBinding, ApiKey, Role

STAND_IN = """
import json, os, signal, sys, time
name = sys.argv[sys.argv.index("--name") + 1]
stop = []
if name not in os.environ.get("STUBBORN", "").split(","):
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
else:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
record = {"argv": sys.argv, "pid": os.getpid(),
          "key": os.environ.get("CLOACINA_AGENT_API_KEY"),
          "database_url": os.environ.get("DATABASE_URL")}
with open(os.path.join(os.environ["RECORDS"], name + ".json"), "w") as fh:
    json.dump(record, fh)
while not stop:
    time.sleep(0.01)
"""


@pytest.fixture
def records(tmp_path, monkeypatch):
    out = tmp_path / "records"
    out.mkdir()
    monkeypatch.setenv("RECORDS", str(out))
    monkeypatch.setenv("DATABASE_URL", "postgresql://server:secret@db/cloacina")
    return out


@pytest.fixture
def actuator(tmp_path, records):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    act = ProcessActuator(
        server_url="http://127.0.0.1:9",
        max_concurrency=3,
        drain_timeout_s=0.5,
        log_dir=tmp_path / "agents",
        manage_py=script,
        pass_env=("RECORDS", "STUBBORN"),  # the stand-in's own knobs: not on the allow-list
    )
    yield act
    act.shutdown(wait_s=2)


def record_of(records: Path, name: str, timeout: float = 10.0) -> dict:
    path = records / f"{name}.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size:
            try:
                return json.loads(path.read_text())
            except ValueError:
                pass
        time.sleep(0.01)
    raise AssertionError(f"{name} never started")


def settle(actuator, tenant, desired, until, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        actuator.reconcile(tenant, desired)
        if until():
            return
        time.sleep(0.05)
    raise AssertionError("the actuator did not settle")


def register(tenant, handle) -> Agent:
    key = ApiKey.objects.get(lookup=handle.key_lookup)
    return Agent.objects.create(tenant=tenant, api_key=key, name=handle.name, target_triple="t")


def test_each_child_gets_its_own_key_in_the_environment_and_no_db_credentials(
    actuator, tenant, records
):
    result = actuator.reconcile(tenant, 2)
    assert result.started == 2
    handles = actuator.actual(tenant)
    assert len(handles) == 2
    keys = set()
    for handle in handles:
        rec = record_of(records, handle.name)
        assert rec["argv"][1:] == [
            "runagent", "--server", "http://127.0.0.1:9", "--name", handle.name,
            "--max-concurrency", "3",
        ]  # fmt: skip
        assert rec["key"] not in " ".join(rec["argv"])  # never on the command line
        assert rec["database_url"] is None  # the agent runs tenant code: no DB credentials
        key = ApiKey.verify(rec["key"])
        assert (key.role, key.tenant_id, key.lookup) == (Role.AGENT, tenant.pk, handle.key_lookup)
        keys.add(rec["key"])
    assert len(keys) == 2


def test_scale_down_drains_the_newest_and_revokes_its_key_after_it_exits(actuator, tenant, records):
    actuator.reconcile(tenant, 3)
    handles = sorted(actuator.actual(tenant), key=lambda h: int(h.name.rsplit("-", 1)[1]))
    agents = [register(tenant, h) for h in handles]
    for h in handles:
        record_of(records, h.name)  # started and listening for SIGTERM
    result = actuator.reconcile(tenant, 2)
    assert result.stopped == 1
    newest = handles[-1]
    assert Agent.objects.get(pk=agents[-1].pk).state == "draining"
    assert {h.name for h in actuator.actual(tenant)} == {handles[0].name, handles[1].name}
    settle(actuator, tenant, 2, lambda: not actuator.draining(tenant))
    assert ApiKey.objects.get(lookup=newest.key_lookup).revoked_at is not None
    assert all(ApiKey.objects.get(lookup=h.key_lookup).revoked_at is None for h in handles[:2])


def test_a_child_that_will_not_drain_is_killed_after_the_timeout(
    actuator, tenant, records, monkeypatch
):
    monkeypatch.setenv("STUBBORN", f"proc-{os.getpid()}-1")
    actuator.reconcile(tenant, 1)
    [handle] = actuator.actual(tenant)
    record_of(records, handle.name)
    actuator.reconcile(tenant, 0)
    time.sleep(0.2)
    actuator.reconcile(tenant, 0)
    assert actuator.draining(tenant)  # SIGTERM ignored, still within the drain timeout
    settle(actuator, tenant, 0, lambda: not actuator.draining(tenant), timeout=5)
    assert ApiKey.objects.get(lookup=handle.key_lookup).revoked_at is not None


def test_a_crashed_child_is_restarted_under_its_name_with_a_new_key(actuator, tenant, records):
    actuator.reconcile(tenant, 1)
    [before] = actuator.actual(tenant)
    pid = record_of(records, before.name)["pid"]
    (records / f"{before.name}.json").unlink()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while actuator.actual(tenant) and time.monotonic() < deadline:  # until the kill lands
        time.sleep(0.01)
    assert actuator.actual(tenant) == []  # seen as gone; reconcile (not actual) restarts it
    result = actuator.reconcile(tenant, 1)
    assert (result.restarted, result.started) == (1, 0)
    [after] = actuator.actual(tenant)
    assert after.name == before.name and after.ident != before.ident
    assert ApiKey.objects.get(lookup=before.key_lookup).revoked_at is not None
    assert record_of(records, after.name)["pid"] != pid


def test_losing_the_leadership_drains_every_child(actuator, tenant, other_tenant, records):
    actuator.reconcile(tenant, 1)
    actuator.reconcile(other_tenant, 1)
    for h in actuator.actual(tenant) + actuator.actual(other_tenant):
        record_of(records, h.name)
    actuator.leadership_lost()
    assert actuator.actual(tenant) == [] and actuator.actual(other_tenant) == []
    assert len(actuator.draining(tenant)) == 1


def test_shutdown_stops_every_child_and_revokes_every_key(actuator, tenant, records):
    actuator.reconcile(tenant, 2)
    for h in actuator.actual(tenant):
        record_of(records, h.name)
    procs = [c.proc for kids in actuator._children.values() for c in kids]
    actuator.shutdown(wait_s=5)
    assert all(p.poll() is not None for p in procs)
    assert not ApiKey.objects.filter(tenant=tenant, revoked_at__isnull=True).exists()


def test_nothing_starts_before_the_server_listens(tmp_path, tenant):
    act = ProcessActuator(server_url=None, log_dir=tmp_path, manage_py=Path(sys.executable))
    result = act.reconcile(tenant, 2)
    assert result.started == 0 and "not listening" in result.notes[0]
    assert not ApiKey.objects.exists()


def test_scale_down_drains_through_the_agent_lifecycle_deadline_and_bindings_included(
    actuator, tenant, records
):
    """The actuator drains like the API does (one owner of the transition): the draining agent
    gets a deadline (past it the liveness sweep evicts it) and loses its affinity bindings,
    so bound work binds afresh to an agent that stays."""
    actuator.reconcile(tenant, 2)
    handles = sorted(actuator.actual(tenant), key=lambda h: int(h.name.rsplit("-", 1)[1]))
    agents = [register(tenant, h) for h in handles]
    for h in handles:
        record_of(records, h.name)
    for agent in agents:
        AffinityBinding.objects.create(
            tenant=tenant, kind="definition", key=agent.name, agent=agent
        )
    before = timezone.now()
    actuator.reconcile(tenant, 1)
    newest = Agent.objects.get(pk=agents[-1].pk)
    assert newest.state == "draining" and newest.drain_requested_at is not None
    assert newest.drain_deadline is not None
    assert timedelta(0) < newest.drain_deadline - before < timedelta(seconds=0.5 + 5)
    bound = set(AffinityBinding.objects.values_list("agent_id", flat=True))
    assert bound == {agents[0].pk}
