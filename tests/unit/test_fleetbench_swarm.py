"""`fleetbench --simulated-agents`: option checks, the swarm's stand-ins and the figures table.

Here: the unit tests (no database, socket or process); the rest are in tests/e2e/test_fleetbench_swarm.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from agents.protocol.work import parse_packet, run_result
from fleet.bench.scale import (
    CONNECT_FLOOR_PER_S,
    CONNECT_TIMEOUT_S,
    ScaleResult,
    ScaleSettings,
    connect_timeout_s,
    spread,
)
from fleet.bench.swarm import (
    STOP_TIMEOUT_S,
    NoFetchCache,
    NoopRunner,
    Swarm,
    SwarmKey,
    stop_timeout_s,
)

PACKET = {
    "outbox_id": 7,
    "task_execution_id": "00000000-0000-0000-0000-000000000001",
    "assignment": 1,
    "function": "bench.steps:noop",
    "context_json": "{}",
    "artifact_digest": "a" * 64,
    "target_triple": "x86_64-unknown-linux-gnu",
    "timeout_s": 30,
}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--simulated-agents", "5"], "--simulated-agents needs --executor fleet"),
        (["--executor", "fleet", "--simulated-agents", "-1"], "--simulated-agents must be >= 0"),
        (["--executor", "fleet", "--simulated-agents", "5", "--tenants", "0"], "--tenants must be >= 1"),
        (["--executor", "fleet", "--simulated-agents", "2", "--tenants", "3"], "--tenants must not exceed"),
        (["--executor", "fleet", "--simulated-agents", "5", "--heartbeat-interval", "0"], "--heartbeat-interval must be > 0"),
        (["--executor", "fleet", "--simulated-agents", "5", "--agents-per-key", "0"], "--agents-per-key must be >= 1"),
        (["--executor", "fleet", "--simulated-agents", "5", "--liveness-windows", "0"], "--liveness-windows must be >= 1"),
    ],
)  # fmt: skip
def test_it_refuses_bad_swarm_options_before_touching_a_database(args, message):
    with pytest.raises(CommandError, match=message):
        call_command("fleetbench", *args)


def test_spread_splits_agents_over_tenants_as_evenly_as_integers_go():
    assert spread(10, 3) == [4, 3, 3]
    assert spread(5000, 10) == [500] * 10
    assert sum(spread(1001, 7)) == 1001


def test_the_noop_runner_answers_a_success_the_agent_turns_into_an_outcome():
    runner = NoopRunner()
    packet = parse_packet(dict(PACKET))
    run = asyncio.run(runner.run(Path("/x"), packet.function, packet.context_json, 30.0))
    body = run_result(packet, run)
    assert body["outcome"] == "success" and body["output"] == {}
    assert (body["outbox_id"], body["assignment"]) == (7, 1)
    assert runner.runs == 1


def test_the_cache_never_fetches():
    fetched = []

    async def fetch() -> bytes:
        fetched.append(1)
        return b""

    cache = NoFetchCache(Path("/tmp/swarm"))
    assert asyncio.run(cache.aget("a" * 64, fetch)) == Path("/tmp/swarm")
    assert fetched == []


def test_a_swarm_counts_its_agents_over_every_key():
    swarm = Swarm("http://127.0.0.1:1", [SwarmKey("t1", "k1", 3), SwarmKey("t2", "k2", 2)])
    assert swarm.size == 5
    assert swarm.counts().started == 0
    swarm.stop()  # never started: nothing to drain


class DrainingAgent:
    """What drain_in_waves uses of an agent: it exits a few loop turns after a drain."""

    def __init__(self, log: list[int]) -> None:
        self.exit_code: int | None = None
        self.log = log

    def request_drain(self, reason: str) -> None:
        self.log.append(1)
        asyncio.get_running_loop().call_later(0.02, self.exit)

    def exit(self) -> None:
        self.exit_code = 0
        self.log.append(-1)


def test_the_swarm_drains_its_agents_a_wave_at_a_time():
    """5,000 drains at once (each a new REST connection) saturated the swarm's own loop and
    none got through; at most ``at_once`` drain together, and every agent is drained."""
    events: list[int] = []
    swarm = Swarm("http://127.0.0.1:1", [SwarmKey("t1", "k1", 10)])
    swarm.agents = [DrainingAgent(events) for _ in range(10)]

    async def drain() -> None:
        await swarm.drain_in_waves(at_once=3)
        while any(agent.exit_code is None for agent in swarm.agents):
            await asyncio.sleep(0.01)

    asyncio.run(drain())
    running = [sum(events[: i + 1]) for i in range(len(events))]
    assert max(running) == 3 and running[-1] == 0
    assert events.count(1) == 10


def test_the_drain_timeout_grows_with_the_swarm():
    assert stop_timeout_s(100) == STOP_TIMEOUT_S
    assert stop_timeout_s(5000) > 2 * STOP_TIMEOUT_S


def test_the_table_lists_every_figure_under_the_settings():
    result = ScaleResult(ScaleSettings(agents=30, tenants=3, tasks=200, heartbeat_s=1.0))
    result.add("agents connected", "30/30")
    result.add("pg deadlocks", "0")
    lines = result.table().splitlines()
    assert lines[0].startswith("fleetbench: executor=fleet simulated-agents=30 tenants=3 tasks=200")
    assert "heartbeat=1sx3" in lines[0]
    assert "agents connected  30/30" in lines
    assert "pg deadlocks      0" in lines


def test_the_connect_phase_leaves_a_slow_machine_time_for_thousands_of_agents():
    assert connect_timeout_s(100) == CONNECT_TIMEOUT_S
    assert connect_timeout_s(5000) == 5000 / CONNECT_FLOOR_PER_S > CONNECT_TIMEOUT_S


@pytest.mark.parametrize(
    ("stand_in", "real"),
    [
        (NoopRunner, "agents.sandbox.task_runner.TaskRunner"),
        (NoFetchCache, "agents.sandbox.package_cache.PackageCache"),
    ],
)
def test_the_stand_ins_take_every_parameter_the_real_parts_take(stand_in, real):
    """The agent calls a stand-in as it calls the real part: a parameter the real part
    gained and the stand-in lacks failed every simulated task (a TypeError per run)."""
    import importlib
    import inspect

    module, name = real.rsplit(".", 1)
    real_class = getattr(importlib.import_module(module), name)
    for method, function in inspect.getmembers(stand_in, inspect.isfunction):
        if method.startswith("_") or not hasattr(real_class, method):
            continue
        wanted = inspect.signature(getattr(real_class, method)).parameters.values()
        taken = inspect.signature(function).parameters.values()
        # Names and kinds (positional, keyword-only) alike.
        assert [(p.name, p.kind) for p in taken] == [(p.name, p.kind) for p in wanted], (
            f"{stand_in.__name__}.{method}"
        )
