"""A fake server for the agent: a real WebSocket server for delivery and an httpx
MockTransport for REST, which registers agents, records every call and frame and pushes
frames on demand.  The agent, its task runner and its package cache stay real."""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from pathlib import Path

import httpx
from websockets.asyncio.server import ServerConnection, serve

from agents.runtime.agent import Agent
from agents.runtime.agent_config import AgentConfig
from agents.runtime.client import AgentClient
from artifacts.store.testing import build_archive
from tests.support.loop import run_async

KEY = "clk_fake00000000_fake-agent-key"


TRIPLE = "x86_64-unknown-linux-gnu"


STEPS = """
import time


def nap(context):
    time.sleep(float(context.get("sleep_s", 0)))
    return {"napped": context.get("sleep_s", 0)}
"""


ARCHIVE = build_archive({"workflow/fakepkg/__init__.py": "", "workflow/fakepkg/steps.py": STEPS})


DIGEST = hashlib.sha256(ARCHIVE).hexdigest()


SCENARIO_TIMEOUT_S = 30.0


class FakeServer:
    """Registers agents, records every REST call and frame, pushes frames on demand.

    With ``result_frames`` it announces at registration that it answers ``result``
    frames; ``socket_answers`` then scripts the answer to each one, in turn: a dict
    (the ``result_ack`` fields beyond type and outbox_id), ``"silent"`` (no answer) or
    ``"close"`` (close the socket instead).  Once the script is used up every result
    frame is acknowledged 200.  With ``batch_frames`` it announces that it takes ``batch``
    frames too, and answers the results of one batch in one batch of acks.
    """

    def __init__(
        self,
        result_frames: bool = False,
        socket_answers: list | None = None,
        batch_frames: bool = False,
        socket_registration: bool = True,
    ) -> None:
        self.result_frames = result_frames
        self.batch_frames = batch_frames
        # Registrations on the delivery socket (``/ws/agents/``), as the real server takes them.
        self.socket_registration = socket_registration
        # Each WebSocket message from the agent, decoded (a batch stays one entry).
        self.messages: list[dict] = []
        self.socket_answers = list(socket_answers or [])
        self.socket_results: asyncio.Queue[dict] = asyncio.Queue()
        self.calls: list[tuple[str, str, dict]] = []
        self.frames: asyncio.Queue[dict] = asyncio.Queue()
        self.sockets: list[ServerConnection] = []
        self.results: asyncio.Queue[dict] = asyncio.Queue()
        self.agent_ids: list[str] = []
        self.artifact_fetches = 0

    # REST, through httpx.MockTransport
    def http(self, request: httpx.Request) -> httpx.Response:
        assert request.headers["Authorization"] == f"Bearer {KEY}"
        path = request.url.path.removeprefix("/api/v1")
        body = json.loads(request.content) if request.content else {}
        self.calls.append((request.method, path, body))
        if path == "/agents/register":
            return httpx.Response(201, json=self._register(body))
        if path.endswith("/results"):
            self.results.put_nowait(body)
            return httpx.Response(200, json={"applied": True, "reason": ""})
        if path.startswith("/artifacts/"):
            self.artifact_fetches += 1
            if path == f"/artifacts/{DIGEST}":
                return httpx.Response(200, content=ARCHIVE)
            return httpx.Response(404, json={"detail": "unknown artifact"})
        if path.endswith("/heartbeat"):
            return httpx.Response(200, json={"state": "live", "drain": False})
        if path.endswith("/deregister"):
            return httpx.Response(200, json={})
        return httpx.Response(404, json={"detail": "no such endpoint"})

    def process_request(self, connection: ServerConnection, request):
        """An older server has no registering socket: its handshake is refused over HTTP."""
        if request.path == "/ws/agents/" and not self.socket_registration:
            return connection.respond(404, "no route\n")
        return None

    def _register(self, body: dict) -> dict:
        """A new agent id for a registration ``body`` (REST or the socket): the answer."""
        agent_id = str(uuid.uuid4())
        self.agent_ids.append(agent_id)
        return {
            "agent_id": agent_id,
            "name": body["name"],
            "heartbeat_interval_s": 0.2,
            "liveness_misses": 3,
            "wire_format": "json",
            "ws_path": f"/ws/agents/{agent_id}/",
            "server_protocol_version": 1,
            **({"result_frames": True} if self.result_frames else {}),
            **({"batch_frames": True} if self.batch_frames else {}),
        }

    # the delivery socket
    async def ws(self, connection: ServerConnection) -> None:
        assert connection.request.headers["Authorization"] == f"Bearer {KEY}"
        if connection.request.path == "/ws/agents/":
            body = json.loads(await connection.recv())
            assert body.pop("type") == "register"
            # Recorded as the REST call it replaces: the scenarios count registrations.
            self.calls.append(("WS", "/agents/register", body))
            await connection.send(json.dumps({"type": "registered", **self._register(body)}))
        self.sockets.append(connection)
        async for message in connection:
            frame = json.loads(message)
            self.messages.append(frame)
            inner = frame["frames"] if frame["type"] == "batch" else [frame]
            acks = []
            for item in inner:
                if item["type"] == "result":
                    ack = await self._answer_result(connection, item)
                    if ack == "closed":
                        return
                    if ack is not None:
                        acks.append(ack)
                elif item["type"] != "heartbeat":
                    self.frames.put_nowait(item)
            if len(acks) == 1:
                await connection.send(json.dumps(acks[0]))
            elif acks:
                await connection.send(json.dumps({"type": "batch", "frames": acks}))

    async def _answer_result(self, connection: ServerConnection, frame: dict) -> dict | str | None:
        """The ``result_ack`` for ``frame``, None (silent) or ``"closed"``."""
        self.socket_results.put_nowait(frame)
        answer = self.socket_answers.pop(0) if self.socket_answers else {"status": 200}
        if answer == "close":
            await connection.close(1011, "server going away")
            return "closed"
        if answer == "silent":
            return None
        ack = {"type": "result_ack", "outbox_id": frame["outbox_id"], **answer}
        if answer.get("status") == 200:
            ack.setdefault("applied", True)
            ack.setdefault("reason", "")
        return ack

    async def next_frame(self, kind: str) -> dict:
        while True:
            frame = await self.frames.get()
            if frame["type"] == kind:
                return frame

    async def push(self, packet: dict) -> None:
        await self.sockets[-1].send(json.dumps({"type": "work", "packet": packet}))

    async def push_batch(self, packets: list[dict]) -> None:
        """Several work packets in one ``batch`` frame."""
        work = [{"type": "work", "packet": p} for p in packets]
        await self.sockets[-1].send(json.dumps({"type": "batch", "frames": work}))

    def paths(self) -> list[str]:
        return [path for _method, path, _body in self.calls if not path.endswith("/heartbeat")]


def packet(outbox_id: int, sleep_s: float = 0.0, **changes) -> dict:
    body = {
        "outbox_id": outbox_id,
        "task_execution_id": str(uuid.UUID(int=outbox_id)),
        "assignment": 1,
        "attempt": 1,
        "workflow_execution_id": str(uuid.uuid4()),
        "task_name": f"nap-{outbox_id}",
        "function": "fakepkg.steps:nap",
        "context_json": json.dumps({"sleep_s": sleep_s}),
        "artifact_digest": DIGEST,
        "package_kind": "python",
        "target_triple": TRIPLE,
        "timeout_s": 30.0,
        "tenant": "acme",
    }
    body.update(changes)
    return body


def run_scenario(tmp_path: Path, scenario, **fake_options) -> None:
    """Run ``scenario(fake, agent, agent_task)`` with an agent connected to a fresh fake."""

    async def main() -> None:
        fake = FakeServer(**fake_options)
        async with serve(fake.ws, "127.0.0.1", 0, process_request=fake.process_request) as server:
            port = server.sockets[0].getsockname()[1]
            url = f"http://127.0.0.1:{port}"
            config = AgentConfig(
                server_url=url,
                api_key=KEY,
                name="fake-agent",
                target_triple=TRIPLE,
                cache_dir=tmp_path / "cache",
                cache_max_bytes=100 * 1024 * 1024,
                max_concurrency=2,
            )
            client = AgentClient(url, KEY, transport=httpx.MockTransport(fake.http))
            agent = Agent(config, client=client)
            agent_task = asyncio.create_task(agent.run())
            try:
                async with asyncio.timeout(SCENARIO_TIMEOUT_S):
                    await scenario(fake, agent, agent_task)
            finally:
                if not agent_task.done():
                    agent.on_signal("SIGTERM")
                    agent.on_signal("SIGTERM")  # second signal: stop now
                    await asyncio.wait({agent_task}, timeout=10)

    run_async(main())
