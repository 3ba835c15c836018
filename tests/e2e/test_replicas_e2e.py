"""Three `serve` replicas on one PostgreSQL, four real agents spread over them (each with
all three URLs in its --server list).  The replica that leads the control plane is kill -9'd
in the middle of a dispatch.  Its agents reconnect to the survivors at once (no eviction),
another replica takes the leadership within one control tick, results reported to a
replica that did not place their task are applied there, and every task completes exactly
once (the chaos ledger: each task function appends a line when it runs).

Then a survivor is stopped with SIGTERM: it hands its agents over (close 4012), and they
are connected to the last replica within a second or two, again without an eviction.
"""

from __future__ import annotations

import signal
import time

import pytest

from agents.models import Agent
from fleet.models import ApiKey, ServerInstance, Tenant
from tests.support.chaos import (
    WIDE,
    Feeder,
    Figures,
    check_invariants,
    package,
    query,
    wait_all_terminal,
)
from tests.support.processes import (
    AGENT_READY,
    FLEET_ENV,
    LEADER_LINE,
    READY_LINE,
    Processes,
    ServeHandle,
    current_database_url,
    start_agent,
    wait_for_http,
)
from tests.support.server_api import upload
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e

TICK_S = 0.5  # the control tick (CLOACINA_AUTOSCALE_INTERVAL_S)
REPLICA_ENV = {
    **FLEET_ENV,
    # 1 s beats × 5: an agent that reconnects within seconds must never be evicted.
    "CLOACINA_AGENT_HEARTBEAT_INTERVAL_S": "1.0",
    "CLOACINA_AGENT_LIVENESS_MISSES": "5",
    "CLOACINA_AUTOSCALE": "false",
    "CLOACINA_AUTOSCALE_INTERVAL_S": str(TICK_S),
}
AGENTS = 4
SLOTS = 4
EXECUTIONS = 24  # × 10 independent tasks
FEED_S = 4.0
TASK_SLEEP_S = 0.3
SETTLE_TIMEOUT_S = 90.0


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path, **REPLICA_ENV) as procs:
        yield procs


def start_replicas(procs: Processes, count: int) -> list[ServeHandle]:
    """``count`` replicas started together (each waits for its peers only at the database)."""
    started = [
        procs.start(["serve", "--port", "0"], name=f"serve-{'abc'[n]}") for n in range(count)
    ]
    handles = []
    for process in started:
        url = process.wait_for_output(READY_LINE, 90).group(1)
        wait_for_http(f"{url}/healthz", timeout=20.0, process=process)
        handles.append(ServeHandle(process, url))
    return handles


def leader_of(replicas: list[ServeHandle]) -> ServeHandle | None:
    """The one replica whose log says it took the leadership."""
    leading = [r for r in replicas if LEADER_LINE.search(r.process.output())]
    return leading[0] if len(leading) == 1 else None


def instance_id(replica: ServeHandle) -> str:
    """The replica's ServerInstance id (its row names the port it listens on)."""
    port = int(replica.url.rsplit(":", 1)[1])
    return ServerInstance.objects.get(port=port, stopped_at__isnull=True).id


def connected(names: list[str]) -> dict[str, str]:
    """Agent name → the server id its live socket is on ('' while it has none)."""
    rows = Agent.objects.filter(name__in=names, state="live").values_list("name", "connected_to")
    return dict(rows)


def test_three_replicas_one_killed_mid_dispatch_lose_nothing(procs, tmp_path, capsys):
    tenant = Tenant.objects.create(name="acme")
    names = [f"agent-{i}" for i in range(AGENTS)]
    write = ApiKey.mint("write", tenant)[1]
    agent_key = ApiKey.mint("agent", tenant)[1]
    url = current_database_url()
    ledger = tmp_path / "ledger.jsonl"
    replicas = start_replicas(procs, 3)
    urls = [r.url for r in replicas]

    def logs() -> str:
        tails = "\n".join(f"=== {p.name}\n{p.tail(30)}" for p in procs.processes)
        servers = list(ServerInstance.objects.values_list("id", "port", "stopped_at"))
        return f"{tails}\nservers: {servers}\nagents: {connected(names)}"

    upload(replicas[0], write, package(WIDE))
    agents = []
    for i, name in enumerate(names):
        # Agent i starts on replica i % 3 and knows the other two as its fallbacks.
        order = urls[i % 3 :] + urls[: i % 3]
        fallbacks = ("--server", ",".join(order[1:]))
        agents.append(
            start_agent(procs, order[0], agent_key, name, *fallbacks, slots=SLOTS, wait=False)
        )
    for agent in agents:
        agent.wait_for_output(AGENT_READY, 90)
    victim = wait_until(lambda: leader_of(replicas), what="one leader", logs=logs)
    leader_id = instance_id(victim)
    survivors = [r for r in replicas if r is not victim]
    survivor_ids = {instance_id(r): r for r in survivors}
    on_victim = wait_until(
        lambda: [n for n, server in connected(names).items() if server == leader_id],
        what="an agent connected to the leading replica",
        logs=logs,
    )

    feeder = Feeder(urls, write, [WIDE] * EXECUTIONS, FEED_S, ledger, TASK_SLEEP_S)
    started = time.monotonic()
    feeder.start()
    # In the middle of the dispatch: packets the victim placed out on agents, and packets
    # out on the victim's own agents.
    in_flight = (
        "SELECT count(*) FILTER (WHERE t.claimed_by = %s), "
        "       count(*) FILTER (WHERE a.connected_to = %s) "
        "FROM delivery_outbox o "
        "JOIN fleet_taskexecution t ON t.id = o.task_execution_id AND t.assignment = o.assignment "
        "JOIN agents_agent a ON a.id = o.agent_id WHERE o.state = 'delivered'"
    )
    wait_until(
        lambda: min(query(url, in_flight, (leader_id, leader_id))[0]) >= 2,
        what="packets in flight placed by the leading replica and on its agents",
        timeout=60,
        logs=logs,
        interval=0.02,
    )
    killed_at = time.monotonic()
    victim.process.kill_group()  # kill -9: no shutdown hook, no close frame
    victim.process.popen.wait(10)
    [(killed_db_time,)] = query(url, "SELECT now()")

    # Leadership moves within about one tick.
    new_leader = wait_until(
        lambda: next((r for r in survivors if LEADER_LINE.search(r.process.output())), None),
        what="a survivor to take the leadership",
        timeout=10,
        logs=logs,
        interval=0.02,
    )
    takeover_s = time.monotonic() - killed_at
    # Its agents are on the survivors again, under the same registrations.
    wait_until(
        lambda: (
            len(connected(names)) == AGENTS and set(connected(names).values()) <= set(survivor_ids)
        ),
        what="every agent connected to a surviving replica",
        timeout=15,
        logs=logs,
    )
    moved_s = time.monotonic() - killed_at

    feeder.join(FEED_S + 60)
    assert not feeder.is_alive(), "the feeder never got all executions in"
    open_ = wait_all_terminal(url, SETTLE_TIMEOUT_S)
    elapsed = time.monotonic() - started
    figures = check_invariants(url, ledger, killed=None)
    cross = query(
        url,
        # Outcomes of tasks the dead replica's dispatch placed, applied after it died:
        # reported to, and applied by, a replica that never placed them.
        "SELECT count(*) FROM fleet_taskoutcome o JOIN fleet_taskexecution t "
        "ON t.id = o.task_execution_id "
        "WHERE o.applied AND t.claimed_by = %s AND o.received_at > %s",
        (leader_id, killed_db_time),
    )[0][0]

    # A graceful stop (SIGTERM) of the other follower hands its agents to the last replica.
    [last_id] = [i for i, r in survivor_ids.items() if r is new_leader]
    [(stop_id, stopping)] = [(i, r) for i, r in survivor_ids.items() if r is not new_leader]
    stop_at = time.monotonic()
    stopping.process.signal(signal.SIGTERM)
    wait_until(
        lambda: len(connected(names)) == AGENTS and set(connected(names).values()) == {last_id},
        what="every agent handed over to the last replica",
        timeout=15,
        logs=logs,
    )
    handed_over_s = time.monotonic() - stop_at
    told_to_move = [a.name for a in agents if "closed by the server (4012" in a.output()]
    [(evictions_after_stop,)] = query(url, "SELECT count(*) FROM fleet_eviction")

    v = {
        "replicas / agents (slots)": f"3 / {AGENTS} ({SLOTS})",
        "agents on the killed leader": on_victim,
        "leadership moved after (s)": round(takeover_s, 2),
        "its agents on survivors after (s)": round(moved_s, 2),
        "outcomes of the dead replica's tasks applied elsewhere": cross,
        "graceful stop: agents handed over after (s)": round(handed_over_s, 2),
        "run time (s)": round(elapsed, 1),
        **figures.values,
    }
    with capsys.disabled():
        print("\nthree-replica figures:\n" + Figures(values=v).table())
    assert open_ == 0, f"{open_} executions still open after {SETTLE_TIMEOUT_S}s\n{logs()}"
    assert not figures.violations, "\n".join(figures.violations)
    assert v["executions by status"] == {"Completed": v["executions"]}
    assert v["executions"] >= EXECUTIONS and v["tasks"] == v["executions"] * 10
    assert takeover_s < 2 * TICK_S + 1.0, f"takeover took {takeover_s:.2f}s"
    assert v["evictions"] == 0, figures.evictions  # the agents moved; none went silent
    assert cross >= 1  # the killed replica's dispatches were finished by the others
    assert handed_over_s < 10.0, logs()  # seconds, not a liveness window and a backoff
    assert evictions_after_stop == 0
    assert stop_id not in connected(names).values()
    assert told_to_move, logs()  # the stopping replica sent its agents elsewhere (4012)
    for replica in replicas:
        assert "Exception inside application" not in replica.process.output(), replica.process.tail(
            80
        )
