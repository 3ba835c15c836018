"""The agent against the real server: real `serve --default-executor fleet`, real `runagent`
processes, real WebSockets, the test PostgreSQL.

Where a test needs the server to misbehave (a packet for the wrong triple, a second push of
a packet) it tampers with ``delivery_outbox`` in the database, and the server's own relay
delivers the result to the agent.
"""

from __future__ import annotations

import re
import signal

import pytest
from django.db import connection
from django.utils import timezone

from agents.models import Agent
from fleet.models import DeliveryOutbox, Eviction, TaskExecution, TaskOutcome
from tests.support.keys import cli_agent_key, cli_tenant_key
from tests.support.processes import (
    SHORT_REDELIVERY,
    Processes,
    fleet_serve,
    free_port,
    start_agent,
    wait_exit,
)
from tests.support.server_api import start, upload, wait_terminal
from tests.support.waiting import wait_until
from tests.support.workloads import agent_package, runs_of, slow_context

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

OTHER_TRIPLE = "aarch64-unknown-linux-gnu"


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


@pytest.fixture
def fleet(procs):
    """A fleet server with the slow one-task package uploaded: (server, write key, agent key)."""
    key = cli_tenant_key(procs)
    akey = cli_agent_key(procs)
    server = fleet_serve(procs, **SHORT_REDELIVERY)
    upload(server, key, agent_package())
    return server, key, akey


def test_sigterm_drains_the_task_in_flight_then_deregisters_and_exits_0(procs, fleet, tmp_path):
    server, key, akey = fleet
    agent = start_agent(procs, server.url, akey, "drainer")
    context = slow_context(tmp_path, sleep_s=2.0)
    execution_id = start(server, key, "agentwf", context)
    wait_until(lambda: runs_of(context) == 1, what="the task started on the agent")

    agent.signal(signal.SIGTERM)
    # The server hears of the drain at once and places no more work on the agent.
    wait_until(
        lambda: Agent.objects.filter(name="drainer", state="draining").exists(), timeout=10,
        what="the agent shown as draining",
    )  # fmt: skip
    assert wait_exit(agent, timeout=30) == 0, agent.tail()

    # The task was finished and reported before the agent left: nothing was moved elsewhere.
    task = TaskExecution.objects.get(workflow_execution_id=execution_id)
    assert (task.status, task.output_context) == ("Completed", {"slept_s": 2.0})
    assert runs_of(context) == 1
    row = Agent.objects.get(name="drainer")
    assert row.state == "stopped"  # deregistered (a clean exit is not a death) …
    assert not Eviction.objects.filter(agent=row).exists()  # … cleanly, not evicted
    log = agent.output()
    assert (
        log.index("draining (received SIGTERM): 1 task(s) in hand")
        < log.index("finished: success")
        < log.index("deregistered agent")
    )
    assert wait_terminal(server, key, execution_id)["status"] == "Completed"


def test_a_drain_requested_by_the_server_stops_the_agent_cleanly(procs, fleet):
    server, _key, akey = fleet
    agent = start_agent(procs, server.url, akey, "told-to-go")
    Agent.objects.filter(name="told-to-go").update(drain_requested_at=timezone.now())
    assert wait_exit(agent, timeout=20) == 0, agent.tail()
    assert "the server" in agent.output() and "drain" in agent.output()
    assert Agent.objects.get(name="told-to-go").state == "stopped"


def test_the_agent_reconnects_to_a_restarted_server_and_loses_no_result(procs, tmp_path):
    key = cli_tenant_key(procs)
    akey = cli_agent_key(procs)
    port = free_port()
    server = fleet_serve(procs, port=port, name="serve-first", **SHORT_REDELIVERY)
    upload(server, key, agent_package())
    agent = start_agent(procs, server.url, akey, "survivor")
    context = slow_context(tmp_path, sleep_s=1.0, label="across-restart")
    execution_id = start(server, key, "agentwf", context)
    wait_until(lambda: runs_of(context) == 1, what="the task started on the agent")

    server.process.kill_group()  # the server dies while the task runs: no clean shutdown
    # The task finishes while the server is away: its outcome is kept and retried …
    agent.wait_for_output(re.compile(r"could not post the outcome of slow"), 30)
    server = fleet_serve(procs, port=port, name="serve-second", **SHORT_REDELIVERY)

    # … and lands on the restarted server; the task ran once.
    body = wait_terminal(server, key, execution_id, timeout=60)
    assert body["status"] == "Completed", body
    assert runs_of(context) == 1 and body["context"]["slept_s"] == 1.0
    # The outcome may land over REST before the socket is back; the socket does come back.
    wait_until(
        lambda: agent.output().count("delivery socket open") >= 2, what="the agent reconnected"
    )

    # … and it keeps working for the new server, then leaves it cleanly.
    second = slow_context(tmp_path, sleep_s=0, label="after-restart")
    after = wait_terminal(server, key, start(server, key, "agentwf", second), timeout=30)
    assert after["status"] == "Completed" and after["tasks"][0]["agent"] == "survivor"
    assert agent.stop() == 0
    assert "drained and deregistered" in agent.output()


def test_a_packet_for_another_triple_is_refused_naming_both(procs, fleet, tmp_path):
    server, key, akey = fleet
    agent = start_agent(procs, server.url, akey, "picky")
    own = Agent.objects.get(name="picky").target_triple
    # Make the server's first packet of every task claim another triple (a misbehaving server).
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            CREATE FUNCTION test_wrong_triple() RETURNS trigger AS $$
            BEGIN
                IF NEW.assignment = 1 THEN
                    NEW.payload := jsonb_set(NEW.payload, '{{target_triple}}',
                                             '"{OTHER_TRIPLE}"');
                END IF;
                RETURN NEW;
            END; $$ LANGUAGE plpgsql;
            CREATE TRIGGER test_wrong_triple BEFORE INSERT ON delivery_outbox
                FOR EACH ROW EXECUTE FUNCTION test_wrong_triple();
            """
        )
    try:
        context = slow_context(tmp_path, sleep_s=0)
        body = wait_terminal(server, key, start(server, key, "agentwf", context), timeout=30)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER test_wrong_triple ON delivery_outbox")
            cursor.execute("DROP FUNCTION test_wrong_triple()")

    refused = TaskOutcome.objects.get(outcome="refused")
    assert refused.assignment == 1 and refused.applied
    assert OTHER_TRIPLE in refused.error_message and own in refused.error_message
    # A refusal is not the task's failure: it went back to Ready and ran on the next packet.
    assert body["status"] == "Completed" and body["tasks"][0]["attempt"] == 1
    assert runs_of(context) == 1
    assert "refusing" in agent.output()


def test_a_repeated_push_of_a_packet_in_hand_is_not_run_again(procs, fleet, tmp_path):
    server, key, akey = fleet
    agent = start_agent(procs, server.url, akey, "once")
    context = slow_context(tmp_path, sleep_s=2.0)
    execution_id = start(server, key, "agentwf", context)
    wait_until(lambda: runs_of(context) == 1, what="the task started on the agent")

    # The server pushes the same packet again (as after a lost `received`).
    DeliveryOutbox.objects.update(state="pending", delivered_at=None, received_at=None)
    agent.wait_for_output(re.compile("ignoring a repeated push"), 15)

    body = wait_terminal(server, key, execution_id, timeout=30)
    assert body["status"] == "Completed"
    assert runs_of(context) == 1
    row = DeliveryOutbox.objects.get()
    assert row.attempts == 2 and row.state == "acked"  # pushed twice, acked once
    assert TaskOutcome.objects.count() == 1


def test_an_agent_declared_dead_registers_again_and_keeps_working(procs, fleet, tmp_path):
    server, key, akey = fleet
    agent = start_agent(procs, server.url, akey, "phoenix")
    first_id = Agent.objects.get(name="phoenix").pk
    Agent.objects.filter(pk=first_id).update(state="dead")  # as the liveness sweep would

    wait_until(
        lambda: Agent.objects.filter(name="phoenix", state="live").exclude(pk=first_id).exists(),
        what="a new registration",
    )
    context = slow_context(tmp_path, sleep_s=0)
    body = wait_terminal(server, key, start(server, key, "agentwf", context), timeout=30)
    assert body["status"] == "Completed" and body["tasks"][0]["agent"] == "phoenix"
    assert agent.output().count("registered as phoenix") == 2


def test_a_bad_key_stops_the_agent_with_a_clear_message(procs, fleet):
    server, key, _akey = fleet
    bad = start_agent(procs, server.url, "clk_000000000000_not-a-real-key", "bad", wait=False)
    assert wait_exit(bad, timeout=20) == 3
    assert "rejected the API key (401)" in bad.output()
    wrong_role = start_agent(procs, server.url, key, "wrong-role", wait=False)  # a write key
    assert wait_exit(wrong_role, timeout=20) == 3
    assert "(403)" in wrong_role.output()
    assert key not in wrong_role.output()  # the key itself is never logged
