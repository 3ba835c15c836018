"""Handing this server's agents to the other replicas when it stops (SIGTERM).

`serve` first makes the fleet executor stop taking sockets (:func:`stop_taking_sockets`:
a socket opened from now on is closed at once), then closes every agent socket it holds
with close code 4012 and :data:`GO_ELSEWHERE_REASON`, straight on daphne's connections
(cloacina_site/daphne_limits.py: the consumers are cancelled by daphne's own shutdown).
The agents reconnect at once to their next ``--server`` (or through the load balancer to
a replica still in it) and report there what they were running; the outcomes reach this
server's waiting dispatches through the ``task_outcome`` notification, so in-flight work
finishes while this process winds down.
"""

from __future__ import annotations

import logging

from fleet.executors.fleet.delivery import local_sockets

log = logging.getLogger(__name__)

# 4000 + RFC 6455's 1012 "Service Restart": daphne (autobahn) lets an application send only
# 1000 and 3000-4999.
CLOSE_GO_ELSEWHERE = 4012
GO_ELSEWHERE_REASON = "server shutting down: connect to another server"
AGENT_SOCKETS_PATH = b"/ws/agents/"  # where the agents' delivery sockets live
HAND_OVER_WAIT_S = 3.0  # how long shutdown waits for the agents to finish closing


def stop_taking_sockets() -> None:
    """From now on every agent socket opened here is closed 4012 (see the consumer)."""
    local_sockets.stop_accepting()
    log.info("taking no more agent sockets: handing the agents over to the other servers")
