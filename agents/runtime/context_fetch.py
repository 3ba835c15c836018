"""Fetching a task's input context that came by reference (``context_ref``).

A context too large for one delivery-socket frame is not in the packet: the packet
names its size and sha256, and the agent GETs the text from
``/api/v1/agents/{its id}/tasks/{task_execution_id}/context?assignment=N`` (answered
only to the agent the packet is addressed to).  An unreachable server is retried for a
while; what comes back must have exactly the announced size and digest.  What cannot
be had becomes the task's outcome: a refusal (the task never ran; the server requeues
it) or, for a context over the server's maximum, a failure.

DB-free, like the rest of the runtime.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

from agents.protocol.work import WorkPacket, refusal, result_body
from agents.runtime.backoff import Backoff
from agents.runtime.client import AgentClient, RequestRejected, ServerUnavailable

FETCH_RETRY_WINDOW_S = 60.0


class ContextUnavailable(Exception):
    """The context cannot be had; :meth:`outcome` is what to report instead of a run."""

    def __init__(self, message: str, error_type: str = "") -> None:
        super().__init__(message)
        self.error_type = error_type  # '' → a refusal; else a failure of this type

    def outcome(self, packet: WorkPacket) -> dict[str, Any]:
        if not self.error_type:
            return refusal(packet, str(self))
        return result_body(packet, "failure", error_type=self.error_type, error_message=str(self))


async def fetch_context(client: AgentClient, agent_id: str, packet: WorkPacket) -> str:
    """The packet's context text, checked against its ``context_ref``."""
    ref = packet.context_ref or {}
    backoff = Backoff()
    deadline = asyncio.get_running_loop().time() + FETCH_RETRY_WINDOW_S
    while True:
        try:
            data = await client.fetch_context(agent_id, packet.task_execution_id, packet.assignment)
            break
        except RequestRejected as exc:
            if exc.status == 413:
                raise ContextUnavailable(str(exc), "ContextTooLarge") from None
            raise ContextUnavailable(f"context not available from the server: {exc}") from None
        except ServerUnavailable as exc:
            if asyncio.get_running_loop().time() >= deadline:
                raise ContextUnavailable(
                    f"context could not be fetched within {FETCH_RETRY_WINDOW_S:g}s: {exc}"
                ) from None
            await asyncio.sleep(backoff.next_delay())
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != ref.get("bytes") or digest != ref.get("sha256"):
        raise ContextUnavailable(
            f"fetched context does not match its reference ({len(data)} bytes, sha256 "
            f"{digest[:12]}…; the packet announced {ref.get('bytes')} bytes, "
            f"{str(ref.get('sha256'))[:12]}…)"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ContextUnavailable("fetched context is not UTF-8 text") from None
