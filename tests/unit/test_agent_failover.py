"""Several servers for one agent: the URL list, failing over between them, and what the
server's "go elsewhere" (4012) and "try later" (4013) closes make the agent do."""

from __future__ import annotations

import random

import httpx
import pytest
from django.core.management import call_command

from agents.management.commands import runagent
from agents.runtime import backoff, connection
from agents.runtime.agent import Agent
from agents.runtime.agent_config import AgentConfig
from agents.runtime.client import AgentClient, ServerUnavailable, server_list
from tests.support.loop import run_async

A, B, C = "http://a:8000", "http://b:8000", "http://c:8000"


def test_server_lists_take_repeats_and_commas_and_drop_duplicates():
    assert server_list("http://a:8000/, http://b:8000") == (A, B)
    assert server_list([A, f"{B},{C}", A]) == (A, B, C)
    assert server_list(A) == (A,)
    with pytest.raises(ValueError, match="no server URL"):
        server_list(" , ")
    with pytest.raises(ValueError, match="all be http:// or all https://"):
        server_list([A, "https://b:8443"])
    with pytest.raises(ValueError, match="server URL must look like"):
        server_list([A, "b:8000"])


def _config_from(monkeypatch, *args: str, env: str | None = None) -> AgentConfig:
    seen: list[AgentConfig] = []

    async def capture(agent) -> int:
        seen.append(agent.config)
        return 0

    monkeypatch.setattr(runagent, "install_db_guard", lambda: None)
    monkeypatch.setattr(runagent, "_configure_logging", lambda: None)
    monkeypatch.setattr(runagent, "_run", capture)
    if env is None:
        monkeypatch.delenv("CLOACINA_SERVER_URL", raising=False)
    else:
        monkeypatch.setenv("CLOACINA_SERVER_URL", env)
    call_command("runagent", "--api-key", "k", *args)
    return seen[0]


def test_runagent_takes_several_servers_from_flags_or_the_environment(monkeypatch, tmp_path):
    cache = ("--cache-dir", str(tmp_path))
    config = _config_from(monkeypatch, "--server", A, "--server", f"{B},{C}", *cache)
    assert config.server_urls == (A, B, C) and config.server_url == A
    config = _config_from(monkeypatch, *cache, env=f"{B}, {A}")
    assert config.server_urls == (B, A)
    single = _config_from(monkeypatch, "--server", f"{A}/", *cache)  # a load balancer
    assert single.server_urls == (A,)


def test_a_mixed_scheme_server_list_is_refused_with_exit_code_2(monkeypatch):
    monkeypatch.setattr(runagent, "install_db_guard", lambda: None)
    monkeypatch.setattr(runagent, "_configure_logging", lambda: None)
    with pytest.raises(Exception) as info:
        call_command("runagent", "--api-key", "k", "--server", f"{A},https://b:8443")
    assert info.value.returncode == 2 and "--server:" in str(info.value)


class Hosts:
    """Answers by host: a dead host refuses the connection, a live one answers 200/503."""

    def __init__(self, answers: dict[str, int]) -> None:
        self.answers = answers
        self.hosts: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.hosts.append(request.url.host)
        status = self.answers[request.url.host]
        if status == 0:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(status, json={"state": "live", "drain": False})


def _beat_twice(hosts: Hosts, servers: tuple[str, ...]) -> list[str]:
    async def scenario() -> list[str]:
        client = AgentClient(servers, "k", transport=httpx.MockTransport(hosts))
        outcomes = []
        try:
            for _ in range(2):
                try:
                    await client.heartbeat("agent-1", {})
                    outcomes.append("ok")
                except ServerUnavailable:
                    outcomes.append("unavailable")
        finally:
            await client.close()
        return outcomes

    return run_async(scenario())


def test_a_request_without_answer_moves_the_client_to_the_next_server():
    hosts = Hosts({"a": 0, "b": 200, "c": 200})
    assert _beat_twice(hosts, (A, B, C)) == ["unavailable", "ok"]
    assert hosts.hosts == ["a", "b"]


def test_a_503_moves_the_client_and_a_single_url_never_moves():
    hosts = Hosts({"a": 503, "b": 200})
    assert _beat_twice(hosts, (A, B)) == ["unavailable", "ok"]
    lone = Hosts({"a": 0})
    assert _beat_twice(lone, (A,)) == ["unavailable", "unavailable"]
    assert lone.hosts == ["a", "a"]


def test_many_callers_noticing_one_outage_move_the_client_once():
    async def scenario() -> list[str]:
        client = AgentClient((A, B, C), "k")
        try:
            return [client.fail_over(A), client.fail_over(A), client.fail_over(B)]
        finally:
            await client.close()

    assert run_async(scenario()) == [B, B, C]


@pytest.mark.parametrize(
    "code, action",
    [
        (4012, connection.Action.MOVE),
        (1012, connection.Action.MOVE),  # a proxy's own "service restart"
        (4013, connection.Action.WAIT),
        (1013, connection.Action.WAIT),
    ],
)
def test_the_servers_go_elsewhere_and_try_later_closes(code, action):
    assert connection.action_for_close(code) is action


def test_a_close_reason_and_a_refused_handshake_say_how_long_to_wait():
    assert connection.retry_after_in_reason("server busy: retry after 3 s") == 3.0
    assert connection.retry_after_in_reason("lost") is None
    limited = connection.handshake_refused(429, "7")
    assert (limited.action, limited.retry_after_s) == (connection.Action.WAIT, 7.0)
    assert connection.handshake_refused(429, "soon").retry_after_s is None
    assert connection.handshake_refused(503, None).action is connection.Action.RECONNECT
    assert connection.handshake_refused(403, None).action is connection.Action.DIAGNOSE


def _agent(tmp_path) -> Agent:
    config = AgentConfig(
        server_url=A,
        api_key="k",
        name="a",
        target_triple="x86_64-unknown-linux-gnu",
        cache_dir=tmp_path / "cache",
        cache_max_bytes=1024 * 1024,
        servers=(A, B),
    )
    return Agent(config)


def _delay_after(tmp_path, end: connection.SessionEnd) -> tuple[float, str]:
    async def scenario() -> tuple[float, str]:
        agent = _agent(tmp_path)
        try:
            delay = agent._reconnect_delay(
                end, A, backoff.Backoff(), backoff.Backoff(backoff.RATE_LIMITED_BASE_S)
            )
            return delay, agent.client.server_url
        finally:
            await agent.client.close()

    return run_async(scenario())


def test_go_elsewhere_reconnects_to_the_next_server_within_a_second(tmp_path):
    end = connection.SessionEnd(connection.Action.MOVE, "closed by the server (4012)", True)
    delay, server = _delay_after(tmp_path, end)
    assert server == B and 0 <= delay <= backoff.MOVE_SPREAD_S


def test_try_later_waits_as_asked_with_jitter_on_the_next_server(tmp_path):
    end = connection.SessionEnd(connection.Action.WAIT, "busy", True, retry_after_s=4.0)
    delay, server = _delay_after(tmp_path, end)
    assert server == B and 4.0 <= delay <= 4.0 + 0.4 + 1e-9


def test_a_lost_socket_moves_on_and_a_refused_handshake_stays(tmp_path):
    lost = connection.SessionEnd(connection.Action.RECONNECT, "lost (1006)", True)
    assert _delay_after(tmp_path, lost)[1] == B
    refused = connection.SessionEnd(connection.Action.DIAGNOSE, "HTTP 403", False)
    assert _delay_after(tmp_path, refused)[1] == A


def test_agents_refused_together_come_back_spread_out():
    rng = random.Random(3)
    waits = [
        backoff.rate_limited_delay(backoff.Backoff(0.01, 60.0, rng=rng), 1.0, rng=rng)
        for _ in range(200)
    ]
    assert min(waits) >= 1.0 and max(waits) <= 1.0 + backoff.RATE_LIMITED_SPREAD_S
    assert max(waits) - min(waits) > backoff.RATE_LIMITED_SPREAD_S / 2  # spread, not one instant
