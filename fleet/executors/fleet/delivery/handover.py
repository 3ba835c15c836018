"""Handing this server's agents to the other replicas when it stops (SIGTERM).

The server first stops taking sockets (a socket opened now is closed at once), then
closes every agent socket it holds with close code 4012 ("service restart": go
elsewhere).  The agents reconnect at once to their next ``--server`` (or through the
load balancer to a replica still in it) and report there what they were running; the
outcomes reach this server's waiting dispatches through the ``task_outcome``
notification, so in-flight work finishes while this process winds down.
"""

from __future__ import annotations

import asyncio
import logging
import time

from channels.exceptions import ChannelFull
from channels.layers import get_channel_layer

from fleet.executors.fleet.delivery import local_sockets

log = logging.getLogger(__name__)

# 4000 + RFC 6455's 1012 "Service Restart": daphne (autobahn) lets an application send only
# 1000 and 3000-4999.
CLOSE_GO_ELSEWHERE = 4012
GO_ELSEWHERE_REASON = "server shutting down: connect to another server"
HAND_OVER_WAIT_S = 3.0  # how long to wait for the sockets to close before stopping anyway
POLL_S = 0.05


async def hand_over_sockets(wait_s: float = HAND_OVER_WAIT_S) -> int:
    """Refuse new sockets, close the open ones with 4012; how many were closed.

    Waits (at most ``wait_s``) until every consumer has let its socket go, so the
    agents have their close frame before the process goes on to stop.
    """
    local_sockets.stop_accepting()
    sockets = local_sockets.snapshot()
    layer = get_channel_layer()
    for socket in sockets.values():
        try:
            await layer.send(
                socket.channel_name,
                {
                    "type": "delivery.close",
                    "code": CLOSE_GO_ELSEWHERE,
                    "reason": GO_ELSEWHERE_REASON,
                },
            )
        except ChannelFull:
            log.warning(
                "agent %s: its channel is full; its socket closes with the process", socket.agent_id
            )
    deadline = time.monotonic() + wait_s
    while local_sockets.snapshot() and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    if sockets:
        log.info("handed %d agent socket(s) over to the other servers (close 4012)", len(sockets))
    return len(sockets)
