"""A task never stays Running when its packet is reclaimed onto its own agent's new
registration (two real `serve` replicas, a real agent process, real sockets).

The interleaving, made exact by the agent's test gates (tests/support/gated_runagent.py):

1. the agent holds finished outcomes it has not reported (gate ``results``);
2. its server is killed; the other replica evicts it after the liveness window (its
   packets wait: no other agent); the server comes back;
3. the agent learns it is unknown, registers anew (new agent id) and opens its socket;
   the sweep reclaims the old id's packets onto the new registration of the very same
   process, and the relay pushes them (the agent does not look at them yet: gate
   ``work``);
4. only then are the outcomes reported, under the OLD id;
5. then the agent reads the pushes.

Before the fix the outcome of step 4 was fenced off ("no longer assigned to this
agent"), the agent filed the packets as reported, ignored the pushes of step 5 without a
``received``, and the server re-pushed them for ever: the execution stayed Running.
Now the outcome counts for the new registration of the same process (its instance id),
or — for an agent without one — is reported again in answer to the push.  Either way
every execution completes and no task completes twice.

``older-agent-late-answer`` holds the server's answers to step 4 (gate ``answers``) until
the agent has read the pushes of step 5: the packets are still in hand, so the pushes are
only acknowledged.  Under load this happened by itself (one task in three stayed Running):
the "not applied" answer under the old id settled the outcome and nothing reported it
again.  Now an answer not applied under an id a push has since replaced sends the outcome
again under the new id (agents/runtime/outcome_reporter.py).
"""

from __future__ import annotations

import pytest

from agents.models import Agent
from artifacts.store.testing import build_archive, manifest_toml
from fleet.models import DeliveryOutbox, TaskExecution, TaskOutcome
from tests.support.keys import cli_agent_key, cli_tenant_key
from tests.support.processes import (
    AGENT_READY,
    Processes,
    fleet_serve,
    free_port,
    start_agent,
)
from tests.support.server_api import start, upload, wait_terminal
from tests.support.waiting import wait_until
from tests.support.workloads import SLOW_ONCE_SOURCE

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

TASKS = 3
TASK_S = 1.0


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


def _package() -> bytes:
    tasks = [
        {"id": f"t{i}", "function": "slowpkg.steps:quick", "timeout_s": 120} for i in range(TASKS)
    ]
    return build_archive(
        {
            "cloacina.toml": manifest_toml(tasks, name="fan", workflow="fan"),
            "workflow/slowpkg/__init__.py": "",
            "workflow/slowpkg/steps.py": SLOW_ONCE_SOURCE,
        }
    )


@pytest.mark.parametrize(
    ("instance_id", "late_answers"),
    [(True, False), (False, False), (False, True)],
    ids=["same-process", "older-agent", "older-agent-late-answer"],
)
def test_a_packet_reclaimed_onto_its_own_agents_new_registration_completes_once(
    procs, tmp_path, instance_id, late_answers
):
    gates = tmp_path / "gates"
    gates.mkdir()
    (gates / "results").touch()
    (gates / "work").touch()
    if late_answers:
        (gates / "answers").touch()
    key = cli_tenant_key(procs)
    akey = cli_agent_key(procs)
    port = free_port()
    replica_a = fleet_serve(procs, port=port, name="serve-a")
    replica_b = fleet_serve(procs, name="serve-b")  # sweeps while A is away
    upload(replica_a, key, _package())
    env = None if instance_id else procs.env(CLOACINA_TEST_NO_INSTANCE_ID="1")
    agent = start_agent(
        procs, replica_a, akey, "bars-a0", slots=TASKS, env=env, wait=False, gates=gates
    )
    agent.wait_for_output(AGENT_READY, 60)
    (old,) = Agent.objects.filter(name="bars-a0").values_list("id", flat=True)

    execution_id = start(replica_a, key, "fan", {"quick_s": TASK_S})
    wait_until(
        lambda: (
            DeliveryOutbox.objects.filter(agent_id=old, received_at__isnull=False).count() == TASKS
        ),
        timeout=30,
        what="the agent to hold every packet",
    )
    # 1–2: the runs finish while their outcomes are held; the server dies.
    wait_until(
        lambda: agent.output().count("finished: success") == TASKS,
        timeout=30,
        what="every run to finish",
    )
    replica_a.process.kill_group()
    replica_a.process.popen.wait(10)
    wait_until(
        lambda: Agent.objects.filter(pk=old, state="dead").exists(),
        timeout=30,
        what="replica B to evict the silent agent",
    )
    replica_a = fleet_serve(procs, port=port, name="serve-a2")

    # 3: registered anew, and its old packets moved onto the new registration.
    def new_registration():
        return Agent.objects.filter(name="bars-a0", state="live").exclude(pk=old).first()

    wait_until(lambda: new_registration() is not None, timeout=30, what="re-registration")
    new = new_registration().pk
    wait_until(
        lambda: DeliveryOutbox.objects.filter(agent_id=new, state="delivered").count() == TASKS,
        timeout=30,
        what="the reclaim onto the new registration, and its pushes",
    )
    assert not TaskOutcome.objects.filter(
        task_execution__workflow_execution_id=execution_id
    ).exists()

    # 4: the outcomes, under the old id.
    (gates / "results").unlink()
    wait_until(
        lambda: (
            TaskOutcome.objects.filter(task_execution__workflow_execution_id=execution_id).count()
            >= TASKS
        ),
        timeout=30,
        what="the outcomes owed under the old id",
    )
    # 5: the agent reads the pushes of packets it has run and reported.
    (gates / "work").unlink()
    if late_answers:  # ... before it knows the server has their outcomes
        wait_until(
            lambda: agent.output().count("(already in hand)") == TASKS,
            timeout=30,
            what="the agent to acknowledge the pushes of packets still in hand",
        )
        (gates / "answers").unlink()

    done = wait_terminal(replica_a, key, execution_id, timeout=45)
    assert done["status"] == "Completed", done
    tasks = TaskExecution.objects.filter(workflow_execution_id=execution_id)
    assert sorted(tasks.values_list("status", flat=True)) == ["Completed"] * TASKS
    for task in tasks:
        applied = TaskOutcome.objects.filter(task_execution=task, applied=True)
        assert applied.count() == 1, list(applied.values())
        assert (task.attempt, task.output_context) == (1, {"quick": 0})  # ran once, no retry
    assert not DeliveryOutbox.objects.filter(
        task_execution__workflow_execution_id=execution_id, state__in=["pending", "delivered"]
    ).exists()
    assert Agent.objects.get(pk=new).in_flight == 0
    if not instance_id:  # the outcome under the old id was fenced; the re-push answered
        assert "reporting its outcome again" in agent.output()
    replica_b.process.stop()
