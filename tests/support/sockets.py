"""The delivery socket in process: a Channels communicator on the ASGI application, the
agent's hello and the close code the server answers with."""

from __future__ import annotations

from channels.testing import WebsocketCommunicator

from cloacina_site.asgi import application
from tests.support.socket_registry import forget_sockets  # noqa: F401  (autouse, re-exported)


def socket(agent_id, key: str | None) -> WebsocketCommunicator:
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    return WebsocketCommunicator(application, f"/ws/agents/{agent_id}/", headers=headers)


async def close_code(comm: WebsocketCommunicator, timeout: float = 10.0) -> int:
    """Skip any frames until the server closes; return the close code (the wait is generous:
    a loaded CI machine can take seconds to schedule the consumer that closes)."""
    while True:
        message = await comm.receive_output(timeout)
        if message["type"] == "websocket.close":
            return message.get("code")


async def opened(
    comm: WebsocketCommunicator, hello: list | None = None, *, batch_frames: bool = False
) -> None:
    """Connect and say hello (holding ``hello``; taking batched frames if ``batch_frames``)."""
    connected, _ = await comm.connect()
    assert connected
    frame = {"type": "hello", "holding": hello or []}
    if batch_frames:
        frame["batch_frames"] = True
    await comm.send_json_to(frame)
