"""Chaos: the fleet under a seeded schedule of faults, and the invariants afterwards.

A real `serve --default-executor fleet` and 4 real `runagent`s on a PostgreSQL of the
run's own work through executions of three workflow shapes (chain, diamond, fan-out)
started at an even pace, while the schedule SIGKILLs agents (the test starts a
replacement under a new name), SIGKILLs and restarts `serve` (same port; the agents
reconnect) and crashes PostgreSQL itself (``pg_ctl -m immediate``) and starts it again.

Afterwards: every workflow is terminal; no task has more than one applied success and
every Completed task exactly one; every task whose function ran (its ledger line) is
Completed; no outbox row is left in flight; the evicted agents are exactly the killed
ones and the packets moved match what the evictions counted.  Tasks may run more than
once (at-least-once execution: counted from the ledger), never complete more than once.

The default run is short (CI); ``CLOACINA_CHAOS_TASKS=1000`` (with more faults, scaled
to the size) is the long one.  ``CLOACINA_CHAOS_SEED`` picks the schedule.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from tests.support.chaos import (
    SHAPES,
    WIDE,
    Feeder,
    Figures,
    check_invariants,
    package,
    plan,
    query,
    schedule,
    wait_all_terminal,
)
from tests.support.processes import FLEET_ENV, Processes, fleet_serve, free_port, start_agent
from tests.support.server_api import metric, upload

pytestmark = [pytest.mark.chaos, pytest.mark.e2e]

TASKS = int(os.environ.get("CLOACINA_CHAOS_TASKS", "200"))
SEED = int(os.environ.get("CLOACINA_CHAOS_SEED", "20261130"))
LONG = TASKS >= 1000
FEED_S = 150.0 if LONG else 30.0
FAULTS = {"kills": 8, "serve_restarts": 2, "pg_restarts": 2} if LONG else {
    "kills": 2, "serve_restarts": 1, "pg_restarts": 1,
}  # fmt: skip
AGENTS = 4
SLOTS = 4
SETTLE_TIMEOUT_S = 240.0 if LONG else 90.0
TASK_SLEEP_S = 0.3  # keeps agents busy, so kills land on work in flight


def test_chaos_run_loses_nothing_and_completes_nothing_twice(own_postgres, tmp_path, capsys):
    pg, url = own_postgres
    ledger = tmp_path / "ledger.jsonl"
    rng = random.Random(SEED)
    faults = schedule(
        SEED, FEED_S, FAULTS["kills"], FAULTS["serve_restarts"], FAULTS["pg_restarts"]
    )
    port = free_port()
    with Processes(tmp_path, DATABASE_URL=url, **FLEET_ENV) as procs:
        server = fleet_serve(procs, port=port, name="serve-0")
        created = procs.manage("createtenant", "acme")
        assert created.returncode == 0, created.stderr
        write = procs.manage("mintkey", "--tenant", "acme", "--role", "write").stdout.strip()
        agent_key = procs.manage("mintkey", "--tenant", "acme", "--role", "agent").stdout.strip()
        for shape in SHAPES:
            upload(server, write, package(shape))
        agents = {
            f"agent-{i}-0": start_agent(procs, server, agent_key, f"agent-{i}-0", slots=SLOTS)
            for i in range(AGENTS)
        }
        workflows = plan(TASKS)
        feeder = Feeder(server.url, write, workflows, FEED_S, ledger, TASK_SLEEP_S)
        started = time.monotonic()
        feeder.start()
        killed: set[str] = set()
        done = {"kill_agent": 0, "restart_serve": 0, "restart_postgres": 0}
        generation = 0
        fault_log: list[tuple[str, str]] = []
        for fault in faults:
            time.sleep(max(0.0, started + fault.at_s - time.monotonic()))
            if fault.kind == "kill_agent":
                # An agent holding work if there is one: the kill must cost something.
                busy = query(
                    url,
                    "SELECT name FROM agents_agent WHERE state IN ('live', 'draining') AND in_flight > 0",
                )
                candidates = sorted({n for (n,) in busy} & set(agents)) or sorted(agents)
                name = candidates[fault.pick % len(candidates)]
                agents.pop(name).kill_group()  # kill -9 of the agent and its task processes
                killed.add(name)
                generation += 1
                slot = name.split("-")[1]
                fresh = f"agent-{slot}-{generation}"
                agents[fresh] = start_agent(
                    procs, server, agent_key, fresh, slots=SLOTS, wait=False
                )
            elif fault.kind == "restart_serve":
                server.process.kill_group()
                server.process.popen.wait(10)
                time.sleep(rng.uniform(0.2, 1.5))
                server = fleet_serve(procs, port=port, name=f"serve-{done['restart_serve'] + 1}")
            else:
                pg.restart(down_s=rng.uniform(0.5, 2.0))
            done[fault.kind] += 1
            fault_log.append((time.strftime("%H:%M:%S"), fault.kind))
        feeder.join(FEED_S + 120)
        assert not feeder.is_alive(), "the feeder never got all executions in"

        open_ = wait_all_terminal(url, SETTLE_TIMEOUT_S)
        elapsed = time.monotonic() - started
        figures = check_invariants(url, ledger, killed)
        evicted_metric = metric(server, "cloacina_fleet_agents_evicted_total")
        reassigned_metric = metric(server, "cloacina_fleet_work_reassigned_total")
        for agent in agents.values():
            agent.signal(signal.SIGTERM)

    v = figures.values
    v = {
        "seed": SEED,
        "workflows started": len(workflows),
        "planned tasks": sum(len(SHAPES[w]) for w in workflows),
        "agents (slots each)": f"{AGENTS} ({SLOTS})",
        "faults: agents kill -9'd": done["kill_agent"],
        "faults: serve kill -9'd + restarted": done["restart_serve"],
        "faults: PostgreSQL crashed + restarted": done["restart_postgres"],
        "PostgreSQL down (s, each)": [round(s, 1) for s in pg.restarts],
        "starts refused while down (retried)": dict(feeder.refused),
        "run time (s)": round(elapsed, 1),
        **v,
        "metrics: evicted_total / reassigned_total": f"{evicted_metric:g} / {reassigned_metric:g}",
    }
    figures.values = v
    with capsys.disabled():
        print("\nchaos run figures:\n" + figures.table())
        print("faults (wall clock, UTC):", fault_log)
        print("evictions (at, agent, reason, last beat, in flight, moved):")
        for row in figures.evictions:
            print("  ", row)
    assert open_ == 0, f"{open_} executions still open after {SETTLE_TIMEOUT_S}s"
    assert not figures.violations, "\n".join(figures.violations)
    assert v["tasks"] >= TASKS
    assert evicted_metric == v["evictions"]
    assert reassigned_metric == v["work reassigned (Eviction.reassigned)"]
    assert v["executions by status"] == {"Completed": v["executions"]}
    # While the server or the database was away, a start got no answer or a 503, never a 500.
    assert set(feeder.refused) <= {"no answer", 503}, feeder.refused


# -- two replicas, one of them killed and restarted -------------------------------------

REPLICA_SEED = int(os.environ.get("CLOACINA_CHAOS_REPLICA_SEED", "20261201"))
REPLICA_EXECUTIONS = 40  # × 10 independent tasks
REPLICA_FEED_S = 6.0
REPLICA_DOWN_S = 5.0
REPLICA_ENV = {  # the liveness of the reproduction in issue 12: 1 s × 3
    **FLEET_ENV,
    "CLOACINA_AGENT_HEARTBEAT_INTERVAL_S": "1.0",
    "CLOACINA_AGENT_LIVENESS_MISSES": "3",
}


def test_two_replicas_one_killed_mid_run_and_restarted_lose_nothing(own_postgres, tmp_path, capsys):
    """Two `serve` replicas on one PostgreSQL, two agents on each, executions started
    through both; one replica is kill -9'd mid-run and started again after more than the
    liveness window.  Its agents' registrations are evicted by the other replica (their
    packets reclaimed onto survivors — or, later, onto the same processes' new
    registrations), they re-register when it is back, and report outcomes owed under
    their old ids.  Every execution must finish, no task complete twice, no packet stay
    open."""
    pg, url = own_postgres
    ledger = tmp_path / "ledger.jsonl"
    rng = random.Random(REPLICA_SEED)
    kill_at = rng.uniform(2.0, 4.0)
    ports = [free_port(), free_port()]
    with Processes(tmp_path, DATABASE_URL=url, **REPLICA_ENV) as procs:
        replicas = [
            fleet_serve(procs, port=port, name=f"serve-{n}", **REPLICA_ENV)
            for n, port in zip("ab", ports, strict=True)
        ]
        assert procs.manage("createtenant", "acme").returncode == 0
        write = procs.manage("mintkey", "--tenant", "acme", "--role", "write").stdout.strip()
        agent_key = procs.manage("mintkey", "--tenant", "acme", "--role", "agent").stdout.strip()
        upload(replicas[0], write, package(WIDE))
        agents = [
            start_agent(procs, replica, agent_key, f"{n}{i}", slots=SLOTS)
            for n, replica in zip("ab", replicas, strict=True)
            for i in range(2)
        ]
        feeder = Feeder(
            [r.url for r in replicas], write, [WIDE] * REPLICA_EXECUTIONS, REPLICA_FEED_S,
            ledger, TASK_SLEEP_S,
        )  # fmt: skip
        started = time.monotonic()
        feeder.start()
        time.sleep(kill_at)
        victim = rng.randrange(2)
        replicas[victim].process.kill_group()
        replicas[victim].process.popen.wait(10)
        time.sleep(REPLICA_DOWN_S)
        replicas[victim] = fleet_serve(
            procs, port=ports[victim], name=f"serve-{'ab'[victim]}-2", **REPLICA_ENV
        )
        feeder.join(REPLICA_FEED_S + 60)
        assert not feeder.is_alive(), "the feeder never got all executions in"
        open_ = wait_all_terminal(url, SETTLE_TIMEOUT_S)
        elapsed = time.monotonic() - started
        figures = check_invariants(url, ledger, killed=None)
        for agent in agents:
            agent.signal(signal.SIGTERM)

    v = {
        "seed": REPLICA_SEED,
        "replica kill -9'd at (s) / down for (s)": f"{'ab'[victim]} {kill_at:.1f} / {REPLICA_DOWN_S:g}",
        "run time (s)": round(elapsed, 1),
        **figures.values,
    }
    with capsys.disabled():
        print("\ntwo-replica chaos figures:\n" + Figures(values=v).table())
        for row in figures.evictions:
            print("  ", row)
    assert open_ == 0, f"{open_} executions still open after {SETTLE_TIMEOUT_S}s"
    assert not figures.violations, "\n".join(figures.violations)
    # A start whose answer died with the replica was retried: one more execution, also done.
    assert v["executions"] >= REPLICA_EXECUTIONS
    assert v["executions by status"] == {"Completed": v["executions"]}
    assert v["tasks"] == v["executions"] * 10
