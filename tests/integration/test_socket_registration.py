"""Registering on the delivery socket (``/ws/agents/``, docs/agent-protocol.md): the REST
registration's checks and bounds as ``refused`` frames and close codes, nothing stored on a
refusal, and a registered socket that goes on as the new agent's delivery socket."""

from __future__ import annotations

import uuid

import pytest
from channels.testing import WebsocketCommunicator

from agents.models import Agent
from cloacina_site.asgi import application
from fleet.executors.fleet.delivery import local_sockets, redelivery
from fleet.models import AgentEventCount
from tests.support.loop import run_async
from tests.support.sockets import forget_sockets  # noqa: F401  (autouse)

pytestmark = pytest.mark.django_db(transaction=True)

TRIPLE = "x86_64-unknown-linux-gnu"
BODY = {"name": "sock-1", "target_triple": TRIPLE, "max_concurrency": 4, "protocol_version": 1,
        "wire_format": "json", "tags": ["gpu"]}  # fmt: skip


def registering(key: str | None) -> WebsocketCommunicator:
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    return WebsocketCommunicator(application, "/ws/agents/", headers=headers)


async def answer_and_close(comm: WebsocketCommunicator, frame: dict | str) -> tuple[dict, int]:
    """Send ``frame`` (a dict as JSON, a string as is) first; the answer and the close code."""
    connected, _ = await comm.connect()
    assert connected
    if isinstance(frame, dict):
        await comm.send_json_to(frame)
    else:
        await comm.send_to(text_data=frame)
    answer = await comm.receive_json_from(10)
    end = await comm.receive_output(10)
    assert end["type"] == "websocket.close"
    await comm.disconnect()
    return answer, end["code"]


def test_a_registration_on_the_socket_answers_like_rest_and_the_socket_delivers(agent_key):
    async def scenario() -> tuple[dict, object]:
        comm = registering(agent_key)
        connected, _ = await comm.connect()
        assert connected
        await comm.send_json_to({"type": "register", **BODY})
        answer = await comm.receive_json_from(10)
        await comm.send_json_to({"type": "hello", "holding": []})
        agent_id = uuid.UUID(answer["agent_id"])
        for _ in range(100):  # the hello registers the socket for the relay
            if local_sockets.get(agent_id) is not None:
                break
            await comm.receive_nothing(0.05)
        held = local_sockets.get(agent_id)
        await comm.disconnect()
        return answer, held

    answer, held = run_async(scenario())
    assert answer["type"] == "registered"
    agent = Agent.objects.get()
    assert answer["agent_id"] == str(agent.pk) and answer["name"] == "sock-1"
    assert answer["ws_path"] == f"/ws/agents/{agent.pk}/"
    assert (answer["wire_format"], answer["batch_frames"], answer["result_frames"]) == (
        "json", True, True,
    )  # fmt: skip
    assert (agent.max_concurrency, agent.tags, agent.connection_generation) == (4, ["gpu"], 1)
    assert held is not None, "the registered socket was not taken as the agent's delivery socket"


@pytest.mark.parametrize(
    ("frame", "detail"),
    [
        ({"type": "register", **BODY, "max_concurrency": True}, "max_concurrency"),
        ({"type": "register", **BODY, "target_triple": "not-a-triple"}, "target_triple"),
        ({"type": "hello", "holding": []}, "must be a register frame"),
        ("not json", "JSON register frame"),
    ],
)
def test_a_bad_registration_is_refused_4422_naming_the_problem(agent_key, frame, detail):
    answer, code = run_async(answer_and_close(registering(agent_key), frame))
    assert (answer["type"], answer["status"], code) == ("refused", 422, 4422)
    assert detail in answer["detail"]
    assert not Agent.objects.exists()


def test_another_protocol_version_is_refused_4409_with_both_versions(agent_key):
    frame = {"type": "register", **BODY, "protocol_version": 2, "version": "agent/9"}
    answer, code = run_async(answer_and_close(registering(agent_key), frame))
    assert (answer["status"], code) == (409, 4409)
    assert "agent speaks protocol 2, this server supports 1" in answer["detail"]
    assert not Agent.objects.exists()


@pytest.mark.parametrize(("key_kind", "code"), [("bad", 4401), ("read", 4403)])
def test_a_bad_or_wrong_key_is_refused(agent_key, read_key, key_kind, code):
    key = {"bad": agent_key[:-2] + "xx", "read": read_key}[key_kind]
    answer, closed = run_async(answer_and_close(registering(key), {"type": "register", **BODY}))
    assert (answer["status"], closed) == (code - 4000, code)
    assert not Agent.objects.exists()


def test_past_the_keys_rate_a_registration_waits_its_turn_4013(agent_key, setting):
    setting(
        CLOACINA_AGENT_REGISTRATIONS_PER_KEY_PER_MINUTE="1", CLOACINA_AGENT_ADMISSIONS_PER_S="0"
    )

    async def first() -> dict:
        comm = registering(agent_key)
        await comm.connect()
        await comm.send_json_to({"type": "register", **BODY})
        answer = await comm.receive_json_from(10)
        await comm.disconnect()
        return answer

    assert run_async(first())["type"] == "registered"
    answer, code = run_async(
        answer_and_close(registering(agent_key), {"type": "register", **BODY, "name": "sock-2"})
    )
    assert (answer["status"], code) == (429, 4013)
    assert 55 <= answer["retry_after_s"] <= 60
    assert answer["detail"].startswith(f"retry after {answer['retry_after_s']} s: ")
    assert list(Agent.objects.values_list("name", flat=True)) == ["sock-1"]


def test_a_stopping_server_sends_a_registering_socket_elsewhere_4012(agent_key):
    local_sockets.stop_accepting()

    async def scenario() -> dict:
        comm = registering(agent_key)
        await comm.connect()
        end = await comm.receive_output(5)
        await comm.disconnect()
        return end

    end = run_async(scenario())
    assert (end["type"], end["code"]) == ("websocket.close", 4012)
    assert not Agent.objects.exists()


def test_the_registration_writes_the_agent_connected_and_its_hello_has_nothing_to_redeliver(
    agent_key, monkeypatch
):
    """One INSERT holds the socket (no UPDATE after it), the connect is still counted once,
    and the hello on the registering socket runs no redelivery statements; a reconnect's
    hello on the agent's own path still does."""
    hellos: list[uuid.UUID] = []
    real_apply_hello = redelivery.apply_hello

    def recording_apply_hello(agent_id, holding):
        hellos.append(agent_id)
        return real_apply_hello(agent_id, holding)

    monkeypatch.setattr(redelivery, "apply_hello", recording_apply_hello)

    async def until_held(agent_id: uuid.UUID, comm: WebsocketCommunicator) -> None:
        for _ in range(100):
            if local_sockets.get(agent_id) is not None:
                return
            await comm.receive_nothing(0.05)
        raise AssertionError("the socket was not taken as the agent's delivery socket")

    async def register_then_reconnect() -> uuid.UUID:
        comm = registering(agent_key)
        await comm.connect()
        await comm.send_json_to({"type": "register", **BODY})
        agent_id = uuid.UUID((await comm.receive_json_from(10))["agent_id"])
        await comm.send_json_to({"type": "hello", "holding": []})
        await until_held(agent_id, comm)
        assert hellos == [], "the registering socket's hello ran the redelivery statements"
        await comm.disconnect()
        again = WebsocketCommunicator(
            application, f"/ws/agents/{agent_id}/",
            headers=[(b"authorization", f"Bearer {agent_key}".encode())],
        )  # fmt: skip
        assert (await again.connect())[0]
        await again.send_json_to({"type": "hello", "holding": []})
        await until_held(agent_id, again)
        await again.disconnect()
        return agent_id

    agent_id = run_async(register_then_reconnect())
    assert hellos == [agent_id]
    connects = AgentEventCount.objects.get(kind="connect", from_state="", to_state="")
    assert connects.count == 2  # the registering socket's (the INSERT) and the reconnect's
    assert Agent.objects.get().connection_generation == 2
