"""The heartbeat loop: a beat every interval (±10 % jitter), over the socket when it is
open, else over REST — so an agent whose socket is down is not declared dead for it.

The REST answer carries what the socket cannot: ``404 unknown agent`` (the server
declared us dead: re-register) and ``drain: true`` (the control plane wants us gone).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from websockets.exceptions import ConnectionClosed

from agents.protocol import frames
from agents.runtime.backoff import jittered, wait_event
from agents.runtime.client import AgentClient, AuthRejected, ClientError, UnknownAgent
from agents.runtime.connection import Session

log = logging.getLogger(__name__)


@dataclass
class BeatTarget:
    agent_id: str | None
    session: Session | None
    interval_s: float


@dataclass
class BeatBody:
    in_flight: int
    running: list[str]
    metrics: dict[str, Any]
    draining: bool

    def rest(self) -> dict[str, Any]:
        return {
            "in_flight": self.in_flight,
            "running": self.running,
            "metrics": self.metrics,
            "draining": self.draining,
        }


class HeartbeatLoop:
    def __init__(
        self,
        client: AgentClient,
        target: Callable[[], BeatTarget],
        body: Callable[[], BeatBody],
        on_unknown_agent: Callable[[str], None],
        on_drain_requested: Callable[[], None],
        on_auth_rejected: Callable[[AuthRejected], None],
    ) -> None:
        self._client = client
        self._target = target
        self._body = body
        self._on_unknown_agent = on_unknown_agent
        self._on_drain_requested = on_drain_requested
        self._on_auth_rejected = on_auth_rejected
        self._wake = asyncio.Event()
        self.sent_ws = 0
        self.sent_rest = 0

    def beat_now(self) -> None:
        """Send the next beat at once (e.g. to announce that the agent is draining)."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            target = self._target()
            await wait_event(self._wake, jittered(target.interval_s))
            self._wake.clear()
            await self.beat_once()

    async def beat_once(self) -> None:
        target = self._target()
        if target.agent_id is None:
            return  # not registered (yet/again): the connection loop is on it
        body = self._body()
        if target.session is not None:
            try:
                await target.session.send(
                    frames.heartbeat(body.in_flight, body.running, body.metrics, body.draining)
                )
                self.sent_ws += 1
                return
            except (ConnectionClosed, OSError):
                pass  # the socket just went down: fall back to REST for this beat
        try:
            answer = await self._client.heartbeat(target.agent_id, body.rest())
        except UnknownAgent:
            log.warning("the server no longer knows agent %s; re-registering", target.agent_id)
            self._on_unknown_agent(target.agent_id)
            return
        except AuthRejected as exc:
            self._on_auth_rejected(exc)
            return
        except ClientError as exc:
            log.debug("REST heartbeat failed: %s", exc)
            return
        self.sent_rest += 1
        if answer.get("drain"):
            log.info("the server asked this agent to drain")
            self._on_drain_requested()
