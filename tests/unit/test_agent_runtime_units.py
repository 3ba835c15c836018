"""The agent runtime's pieces that need no server: backoff, packets, URLs, close codes.

The outcome reporter and REST client are driven through an httpx MockTransport (the HTTP
boundary) for the answers a live server will not give on demand: 503s, 422s, a revoked key.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from types import SimpleNamespace

import httpx
import pytest

from agents.protocol import work
from agents.runtime import backoff, connection
from agents.runtime.agent import EXIT_AUTH, Agent
from agents.runtime.agent_config import AgentConfig
from agents.runtime.client import (
    AgentClient,
    AuthRejected,
    ProtocolMismatch,
    RateLimited,
    RequestRejected,
    ServerUnavailable,
    UnknownAgent,
    normalise_server_url,
    websocket_url,
)
from agents.runtime.heartbeat import BeatBody, BeatTarget, HeartbeatLoop
from agents.runtime.outcome_reporter import HeldTask, OutcomeReporter
from agents.sandbox.task_log import TaskLog
from tests.support.loop import run_async

DIGEST = "ab" * 32
PACKET = {
    "outbox_id": 17,
    "task_execution_id": "7f9c2b1e-8a40-4f5e-9a53-2b0f7f7c1d11",
    "assignment": 3,
    "attempt": 2,
    "workflow_execution_id": "0b0c4f8e-3a4e-4d8e-8f7e-1d2c3b4a5f6e",
    "task_name": "extract",
    "function": "etl_demo.steps:extract",
    "context_json": '{"a": 1}',
    "artifact_digest": DIGEST,
    "package_kind": "python",
    "target_triple": "x86_64-unknown-linux-gnu",
    "timeout_s": 30.0,
    "tenant": "acme",
}


# -- backoff -------------------------------------------------------------------------------


def test_backoff_grows_to_its_cap_with_jitter_and_resets():
    b = backoff.Backoff(base_s=0.2, cap_s=10.0, rng=random.Random(1))
    delays = [b.next_delay() for _ in range(12)]
    assert all(0.1 <= d <= 10.0 for d in delays)
    assert delays[0] <= 0.2 and delays[-1] >= 5.0  # from a fraction of a second to near the cap
    assert max(delays) <= 10.0
    b.reset()
    assert b.next_delay() <= 0.2


def test_heartbeat_jitter_stays_within_ten_percent():
    rng = random.Random(7)
    samples = [backoff.jittered(15.0, rng) for _ in range(1000)]
    assert 13.5 <= min(samples) < 14.0 and 16.0 < max(samples) <= 16.5


def test_wait_event_lets_a_loop_be_cancelled_as_its_event_fires():
    # asyncio.wait_for on Python 3.11 can swallow this cancellation; the agent's loops
    # would then never stop (a hung drain).  wait_event must not.
    async def scenario() -> bool:
        event = asyncio.Event()

        async def loop() -> None:
            while True:
                await backoff.wait_event(event, 10.0)
                event.clear()

        for _ in range(50):
            task = asyncio.create_task(loop())
            await asyncio.sleep(0)
            event.set()
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=2.0)
            if not done:  # the cancellation was swallowed: the loop runs on
                task.cancel()
                return False
        return True

    assert run_async(scenario())


def test_wait_event_reports_whether_the_event_fired():
    async def scenario() -> tuple[bool, bool]:
        event = asyncio.Event()
        timed_out = await backoff.wait_event(event, 0.01)
        event.set()
        return timed_out, await backoff.wait_event(event, 1.0)

    assert run_async(scenario()) == (False, True)


# -- work packets --------------------------------------------------------------------------


def test_a_valid_packet_parses():
    packet = work.parse_packet(PACKET)
    assert packet.key == (PACKET["task_execution_id"], 3)
    assert (packet.outbox_id, packet.attempt, packet.timeout_s) == (17, 2, 30.0)


IDS = (17, PACKET["task_execution_id"], 3)


@pytest.mark.parametrize(
    "change, message, ids",
    [
        ({"function": None}, "missing function", IDS),
        ({"timeout_s": "30"}, "timeout_s has the wrong type", IDS),
        ({"artifact_digest": "../../etc/passwd"}, "not a sha256 hex digest", IDS),
        ({"timeout_s": 0}, "timeout_s must be positive", IDS),
        ({"assignment": True}, "assignment has the wrong type", None),
        ({"task_execution_id": "not-a-uuid"}, "bad outbox_id, task_execution_id", None),
    ],
)
def test_a_bad_packet_is_refused_naming_the_field_and_keeping_its_ids(change, message, ids):
    with pytest.raises(work.PacketError, match=message) as info:
        work.parse_packet({**PACKET, **change})
    assert info.value.ids == ids


def test_a_packet_without_ids_cannot_even_be_refused():
    with pytest.raises(work.PacketError) as info:
        work.parse_packet({"type": "nonsense"})
    assert info.value.ids is None
    with pytest.raises(work.PacketError, match="not an object"):
        work.parse_packet(["a", "list"])


def test_the_triple_check_fails_closed_and_names_both_triples():
    packet = work.parse_packet(PACKET)
    assert work.triple_mismatch(packet, "x86_64-unknown-linux-gnu") is None
    reason = work.triple_mismatch(packet, "aarch64-unknown-linux-gnu")
    assert "x86_64-unknown-linux-gnu" in reason and "aarch64-unknown-linux-gnu" in reason
    # A python package is checked all the same: the server stamps the agent's own triple.
    assert work.triple_mismatch(packet, "x86_64-unknown-linux-musl") is not None


def test_run_outcomes_map_to_protocol_outcomes():
    packet = work.parse_packet(PACKET)
    ok = work.run_result(packet, SimpleNamespace(status="success", output={"x": 1}))
    assert (ok["outcome"], ok["output"], ok["outbox_id"], ok["assignment"]) == (
        "success",
        {"x": 1},
        17,
        3,
    )
    late = SimpleNamespace(
        status="timeout",
        output=None,
        error_type="TaskTimeout",
        error_message="task exceeded its 30s timeout",
        traceback="",
    )
    failed = work.run_result(packet, late)
    assert (failed["outcome"], failed["error_type"]) == ("failure", "TaskTimeout")
    refused = work.refusal(packet, "agent draining")
    assert (refused["outcome"], refused["error_message"]) == ("refused", "agent draining")


def test_an_outcome_carries_what_the_run_printed_and_a_silent_one_nothing():
    packet = work.parse_packet(PACKET)
    printed = SimpleNamespace(status="success", output={}, log=TaskLog("hi\n", 900, 897))
    assert work.run_result(packet, printed)["log"] == {
        "text": "hi\n",
        "bytes": 900,
        "truncated_bytes": 897,
    }
    failed = SimpleNamespace(
        status="failure", output=None, error_type="E", error_message="m", traceback="T",
        log=TaskLog("before the fall\n", 16, 0),
    )  # fmt: skip
    assert work.run_result(packet, failed)["log"]["text"] == "before the fall\n"
    silent = SimpleNamespace(status="success", output={}, log=TaskLog("", 0, 0))
    assert "log" not in work.run_result(packet, silent)


# -- URLs and close codes ------------------------------------------------------------------


def test_server_urls_are_normalised_and_mapped_to_the_socket_url():
    assert normalise_server_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert (
        websocket_url("http://127.0.0.1:8000", "/ws/agents/x/")
        == "ws://127.0.0.1:8000/ws/agents/x/"
    )
    assert (
        websocket_url(normalise_server_url("https://fleet.example/cloacina/"), "/ws/agents/x/")
        == "wss://fleet.example/cloacina/ws/agents/x/"
    )
    for bad in ("127.0.0.1:8000", "ftp://host", "http://"):
        with pytest.raises(ValueError, match="server URL"):
            normalise_server_url(bad)


@pytest.mark.parametrize(
    "code, action",
    [
        (4401, connection.Action.AUTH_FAILED),
        (4403, connection.Action.AUTH_FAILED),
        (4404, connection.Action.REREGISTER),
        (4408, connection.Action.RECONNECT),
        (4429, connection.Action.RECONNECT),
        (1006, connection.Action.RECONNECT),
        (None, connection.Action.RECONNECT),
    ],
)
def test_close_codes_decide_what_the_agent_does(code, action):
    assert connection.action_for_close(code) is action


# -- the REST client and the outcome reporter, at the HTTP boundary --------------------------


class ScriptedServer:
    """Answers each request with the next scripted (status, body); records what it got."""

    def __init__(self, *answers: tuple[int, dict]) -> None:
        self.answers = list(answers)
        self.requests: list[tuple[str, str, dict]] = []
        # Called with the request's number (from 1) as it arrives: what happens meanwhile.
        self.on_request: Callable[[int], None] = lambda _number: None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        self.requests.append((request.method, request.url.path, body))
        self.on_request(len(self.requests))
        assert request.headers["Authorization"] == "Bearer the-key"
        status, answer, *headers = self.answers.pop(0)  # an optional third item: headers
        if status == 0:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(status, json=answer, headers=headers[0] if headers else None)


def _client(server: ScriptedServer) -> AgentClient:
    return AgentClient("http://server:8000", "the-key", transport=httpx.MockTransport(server))


@pytest.mark.parametrize(
    "status, error",
    [
        (0, ServerUnavailable),
        (503, ServerUnavailable),
        (401, AuthRejected),
        (403, AuthRejected),
        (409, ProtocolMismatch),
        (422, RequestRejected),
        (429, RateLimited),
    ],
)
def test_registration_failures_are_sorted_by_what_the_agent_must_do(status, error):
    server = ScriptedServer((status, {"detail": "the reason"}))

    async def scenario():
        client = _client(server)
        try:
            await client.register({"name": "a"})
        finally:
            await client.close()

    with pytest.raises(error) as info:
        run_async(scenario())
    if status:
        assert "the reason" in str(info.value)
    assert server.requests[0][:2] == ("POST", "/api/v1/agents/register")


def _agent(tmp_path, server: ScriptedServer, runner=None) -> Agent:
    config = AgentConfig(
        server_url="http://server:8000",
        api_key="the-key",
        name="a",
        target_triple="x86_64-unknown-linux-gnu",
        cache_dir=tmp_path / "cache",
        cache_max_bytes=1024 * 1024,
    )
    return Agent(config, runner=runner, client=_client(server))


REGISTERED = {"agent_id": "agent-1", "name": "a", "heartbeat_interval_s": 5, "liveness_misses": 3}


def test_a_429_at_registration_waits_its_retry_after_and_registers(tmp_path, caplog):
    server = ScriptedServer(
        (429, {"detail": "this key registered 60 agents"}, {"Retry-After": "1"}),
        (201, REGISTERED),
    )

    async def scenario() -> tuple[bool, float, Agent]:
        agent = _agent(tmp_path, server)
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            return await agent._register(), loop.time() - started, agent
        finally:
            await agent.client.close()

    with caplog.at_level("WARNING", logger="agents.runtime.agent"):
        registered, waited, agent = run_async(scenario())
    assert registered and agent.registration.agent_id == "agent-1"
    assert agent.exit_code is None  # a 429 is not a reason to exit
    assert 1.0 <= waited < 1.5  # Retry-After (plus at most 10 % jitter), not the 0.5 s backoff
    assert len(server.requests) == 2
    retries = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(retries) == 1 and "429" in retries[0] and "60 agents" in retries[0]


def test_a_401_at_registration_still_stops_the_agent(tmp_path):
    server = ScriptedServer((401, {"detail": "revoked"}))

    async def scenario() -> tuple[bool, Agent]:
        agent = _agent(tmp_path, server)
        try:
            return await agent._register(), agent
        finally:
            await agent.client.close()

    registered, agent = run_async(scenario())
    assert not registered
    assert agent.exit_code == EXIT_AUTH and "revoked" in agent.exit_message
    assert len(server.requests) == 1


def test_a_429_wait_grows_honours_retry_after_and_is_capped():
    rng = random.Random(7)
    grows = backoff.Backoff(1.0, 60.0, rng=rng)
    delays = [backoff.rate_limited_delay(grows, None, rng=rng) for _ in range(8)]
    assert 0.5 <= delays[0] <= 1.0 and all(d <= 60.0 for d in delays)
    assert delays[-1] >= 30.0  # 1 × 2^7 capped at 60, drawn in [30, 60]
    fresh = backoff.Backoff(1.0, 60.0, rng=rng)
    assert 20.0 <= backoff.rate_limited_delay(fresh, 20.0, rng=rng) <= 22.0
    assert backoff.rate_limited_delay(fresh, 3600.0, rng=rng) == 60.0  # bounded


def test_an_unknown_agent_heartbeat_is_its_own_error():
    server = ScriptedServer((404, {"detail": "unknown agent"}))

    async def scenario():
        client = _client(server)
        try:
            await client.heartbeat("abc", {"in_flight": 0})
        finally:
            await client.close()

    with pytest.raises(UnknownAgent):
        run_async(scenario())


def _report(
    server: ScriptedServer, agent_id: str = "agent-1", repushed_as: str | None = None
) -> dict:
    """Run one outcome through an OutcomeReporter; what settled and what the server saw.
    ``repushed_as``: while the first report is out, a re-push of the packet (in hand)
    through that agent id arrives, as WorkIntake.on_work records it."""
    packet = work.parse_packet(PACKET)

    async def scenario() -> dict:
        client = _client(server)
        settled: list[HeldTask] = []
        auth_errors: list[AuthRejected] = []
        reporter = OutcomeReporter(client, settled.append, auth_errors.append)
        held = HeldTask(packet.key, agent_id, packet.describe())
        held.result = work.run_result(packet, SimpleNamespace(status="success", output={"x": 1}))
        if repushed_as is not None:
            server.on_request = lambda n: setattr(held, "agent_id", repushed_as) if n == 1 else None
        try:
            reporter.submit(held)
            for _ in range(500):
                if settled or auth_errors:
                    break
                await asyncio.sleep(0.01)
        finally:
            await reporter.cancel_all()
            await client.close()
        return {"settled": settled, "auth": auth_errors, "held": held}

    return run_async(scenario())


def test_an_outcome_is_retried_until_the_server_answers(monkeypatch):
    monkeypatch.setattr(backoff.Backoff, "next_delay", lambda self: 0.01)
    server = ScriptedServer(
        (0, {}), (503, {"detail": "restarting"}), (0, {}), (200, {"applied": True, "reason": ""})
    )
    got = _report(server)
    assert len(got["settled"]) == 1
    assert [r[1] for r in server.requests] == ["/api/v1/agents/agent-1/results"] * 4
    assert all(r[2] == server.requests[0][2] for r in server.requests)  # the same outcome each time


@pytest.mark.parametrize("status", [404, 409])
def test_an_outcome_the_server_no_longer_wants_is_let_go(monkeypatch, status):
    monkeypatch.setattr(backoff.Backoff, "next_delay", lambda self: 0.01)
    server = ScriptedServer((status, {"detail": "never addressed to this agent"}))
    got = _report(server)
    assert len(got["settled"]) == 1 and len(server.requests) == 1


NOT_ASSIGNED = {"applied": False, "reason": "the task is no longer assigned to this agent"}


@pytest.mark.parametrize(
    "first_answer", [(200, NOT_ASSIGNED), (404, {"detail": "never addressed to this agent"})]
)
def test_an_outcome_not_taken_under_an_id_a_repush_replaced_goes_again_under_the_new_id(
    first_answer,
):
    """The agent re-registered: its report under the old id is out when the packet, still
    in hand, is re-pushed through the new id (already answered ``received``).  The old id's
    "not applied" must not settle it, else nothing reports it and the task stays Running."""
    server = ScriptedServer(first_answer, (200, {"applied": True, "reason": ""}))
    got = _report(server, repushed_as="agent-2")
    assert [r[1] for r in server.requests] == [
        "/api/v1/agents/agent-1/results",
        "/api/v1/agents/agent-2/results",
    ]
    assert server.requests[0][2] == server.requests[1][2]  # the same outcome, once more
    assert len(got["settled"]) == 1


def test_an_outcome_not_applied_under_the_id_it_is_still_owed_under_is_let_go():
    """A late or duplicate report is recorded, not applied: nothing to send again."""
    server = ScriptedServer((200, NOT_ASSIGNED))
    got = _report(server)
    assert len(got["settled"]) == 1 and len(server.requests) == 1


def test_an_outcome_applied_under_the_old_id_is_not_sent_again_after_a_repush():
    """The same process under a new registration: the server applied it for the new one."""
    server = ScriptedServer((200, {"applied": True, "reason": ""}))
    got = _report(server, repushed_as="agent-2")
    assert len(got["settled"]) == 1 and len(server.requests) == 1


def test_an_outcome_the_server_rejects_is_replaced_by_a_failure_naming_why(monkeypatch):
    monkeypatch.setattr(backoff.Backoff, "next_delay", lambda self: 0.01)
    server = ScriptedServer(
        (422, {"detail": "output: too large"}), (200, {"applied": True, "reason": ""})
    )
    got = _report(server)
    first, second = server.requests[0][2], server.requests[1][2]
    assert first["outcome"] == "success"
    assert (second["outcome"], second["error_type"], second["output"]) == (
        "failure",
        "ResultRejected",
        None,
    )
    assert "output: too large" in second["error_message"]
    assert len(got["settled"]) == 1


def test_a_revoked_key_while_reporting_stops_the_agent(monkeypatch):
    monkeypatch.setattr(backoff.Backoff, "next_delay", lambda self: 0.01)
    got = _report(ScriptedServer((401, {"detail": "invalid or revoked API key"})))
    assert len(got["auth"]) == 1 and "revoked" in str(got["auth"][0])


def _beat(server: ScriptedServer) -> dict:
    """One REST heartbeat (no socket) through a HeartbeatLoop; which callbacks fired."""
    fired: dict = {"unknown": [], "drain": 0, "auth": []}

    async def scenario() -> None:
        client = _client(server)
        loop = HeartbeatLoop(
            client,
            lambda: BeatTarget("agent-1", None, 15.0),
            lambda: BeatBody(1, ["t-1"], {"free_cpu_pct": 50.0}, False),
            fired["unknown"].append,
            lambda: fired.__setitem__("drain", fired["drain"] + 1),
            fired["auth"].append,
        )
        try:
            await loop.beat_once()
        finally:
            await client.close()

    run_async(scenario())
    return fired


def test_a_rest_heartbeat_sends_what_the_agent_holds():
    server = ScriptedServer((200, {"state": "live", "drain": False}))
    assert _beat(server) == {"unknown": [], "drain": 0, "auth": []}
    method, path, body = server.requests[0]
    assert (method, path) == ("POST", "/api/v1/agents/agent-1/heartbeat")
    assert body == {
        "in_flight": 1,
        "running": ["t-1"],
        "metrics": {"free_cpu_pct": 50.0},
        "draining": False,
    }


def test_a_rest_heartbeat_for_an_unknown_agent_asks_for_a_new_registration():
    fired = _beat(ScriptedServer((404, {"detail": "unknown agent"})))
    assert fired["unknown"] == ["agent-1"] and fired["drain"] == 0


def test_a_rest_heartbeat_answered_with_drain_starts_the_drain():
    assert _beat(ScriptedServer((200, {"state": "draining", "drain": True})))["drain"] == 1


def test_a_rest_heartbeat_with_a_revoked_key_stops_the_agent():
    assert len(_beat(ScriptedServer((401, {"detail": "invalid or revoked API key"})))["auth"]) == 1


def test_a_failed_rest_heartbeat_is_only_skipped():
    assert _beat(ScriptedServer((0, {}))) == {"unknown": [], "drain": 0, "auth": []}


# -- stopping --------------------------------------------------------------------------------


class _QuietRunner:
    """The task runner's interface with nothing to start or stop."""

    def require_reachable(self, path, what: str) -> None:
        pass

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass


class _StuckSession:
    """A delivery session whose close fails (``raises``) or never ends (cancelled)."""

    def __init__(self, raises: bool) -> None:
        self.raises = raises
        self.closing = asyncio.Event()

    async def close(self, reason: str) -> None:
        self.closing.set()
        if self.raises:
            raise RuntimeError("the socket was already gone")
        await asyncio.Event().wait()


@pytest.mark.parametrize("raises", [True, False], ids=["close raises", "close cancelled again"])
def test_a_stopping_agent_cancels_its_loops_even_when_closing_the_socket_fails(tmp_path, raises):
    """Swarm.stop(drain=False) cancels every agent; an agent whose socket close raised or
    was cancelled a second time used to leave its heartbeat loop running past the HTTP
    client it beats through."""

    async def scenario() -> tuple[list[bool], BaseException | None]:
        agent = _agent(tmp_path, ScriptedServer(), runner=_QuietRunner())
        loops: list[asyncio.Task] = []

        async def forever() -> None:
            loops.append(asyncio.current_task())
            await asyncio.Event().wait()

        agent._connection_loop = forever
        agent.heartbeat.run = forever
        session = agent.session = _StuckSession(raises)
        run = asyncio.create_task(agent.run())
        while len(loops) < 2:
            await asyncio.sleep(0)
        run.cancel()  # as the swarm's cancel does
        await session.closing.wait()
        if not raises:
            run.cancel()  # cancelled again while the socket's close hangs
        error: BaseException | None = None
        try:
            await run
        except BaseException as exc:
            error = exc
        await asyncio.sleep(0)  # a loop left running would now get its turn
        stopped = [task.cancelled() for task in loops]  # before asyncio.run cancels leftovers
        await agent.client.close()
        return stopped, error

    stopped, error = run_async(scenario())
    assert isinstance(error, RuntimeError if raises else asyncio.CancelledError)
    assert stopped == [True, True]


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (401, AuthRejected),
        (403, AuthRejected),
        (409, ProtocolMismatch),
        (422, RequestRejected),
        (413, RequestRejected),
        (429, RateLimited),
        (404, ServerUnavailable),
        (500, ServerUnavailable),
    ],
)
def test_a_refused_socket_registration_raises_what_the_same_rest_answer_raises(status, error):
    from agents.runtime.socket_registration import refusal_error

    raised = refusal_error(status, "why", 7.0)
    assert type(raised) is error and "why" in str(raised)
    if error is RateLimited:
        assert raised.retry_after_s == 7.0


def test_each_beat_lets_go_of_the_package_pins_kept_after_the_last_tasks(tmp_path):
    """An agent keeps a package's pin a second after a task (no flock per task); an agent
    whose tasks stopped must not keep other processes sharing its cache from evicting."""
    agent = _agent(tmp_path, ScriptedServer())
    released: list[bool] = []
    agent.cache.release_idle_pins = lambda: released.append(True)  # type: ignore[method-assign]
    agent._beat_body()
    agent._beat_body()
    assert released == [True, True]
    assert agent.cache.pin_linger_s > 0


@pytest.mark.parametrize(
    "teid, valid",
    [
        ("7f9c2b1e-8a40-4f5e-9a53-2b0f7f7c1d11", True),  # the server's form: by regex
        ("7F9C2B1E-8A40-4F5E-9A53-2B0F7F7C1D11", True),  # other spellings: as uuid.UUID has it
        ("{7f9c2b1e-8a40-4f5e-9a53-2b0f7f7c1d11}", True),
        ("7f9c2b1e8a404f5e9a532b0f7f7c1d11", True),
        ("7f9c2b1e-8a40-4f5e-9a53-2b0f7f7c1d1", False),
        ("7f9c2b1e-8a40-4f5e-9a53-2b0f7f7c1d11\n", False),  # no trailing newline, as before
        ("7g9c2b1e-8a40-4f5e-9a53-2b0f7f7c1d11", False),
    ],
)
def test_a_packets_task_id_is_taken_exactly_when_uuid_takes_it(teid, valid):
    assert work._is_uuid(teid) is valid
    assert (work._ids({**PACKET, "task_execution_id": teid}) is not None) is valid
