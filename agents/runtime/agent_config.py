"""The agent's settings, resolved by ``runagent`` (flag > environment > default)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from agents.protocol.wire import DEFAULT_AGENT_FORMAT
from agents.runtime.tls import AgentTLS

DEFAULT_MAX_CONCURRENCY = 1
DEFAULT_CACHE_MAX_MB = 2048
AGENT_VERSION = "cloacina-agent/1.0"
PROTOCOL_VERSION = 1

ENV_SERVER_URL = "CLOACINA_SERVER_URL"
ENV_API_KEY = "CLOACINA_AGENT_API_KEY"
ENV_WIRE_FORMAT = "CLOACINA_WIRE_FORMAT"
# Tests only: make the agent claim another protocol version, to see the server refuse it.
ENV_PROTOCOL_VERSION_OVERRIDE = "CLOACINA_TEST_AGENT_PROTOCOL_VERSION"


@dataclass(frozen=True)
class AgentConfig:
    server_url: str  # the first server (the only one unless ``servers`` names more)
    api_key: str = field(repr=False)  # never in a repr, so never in a log line
    name: str
    target_triple: str
    cache_dir: Path
    cache_max_bytes: int
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    tags: tuple[str, ...] = ()
    capabilities: tuple[str, ...] = ()
    # Take only work that names this agent, one of its tags or a capability (docs/routing.md).
    exclusive: bool = False
    wire_format: str = DEFAULT_AGENT_FORMAT  # msgpack; json on request, or after a 409
    tls: AgentTLS = AgentTLS()
    protocol_version: int = PROTOCOL_VERSION
    # Every server to try, in order (replicas on one database); empty: ``server_url`` alone.
    servers: tuple[str, ...] = ()
    # Register on the delivery socket where the server offers it (one connection, not a
    # REST request and then a socket); False: always over REST, as older agents do.
    register_on_socket: bool = True

    @property
    def server_urls(self) -> tuple[str, ...]:
        return self.servers or (self.server_url,)


def default_name() -> str:
    """``<hostname>-<pid>``: unique per process on a host, readable in the console."""
    return f"{socket.gethostname()}-{os.getpid()}"


def default_cache_dir() -> Path:
    home = os.environ.get("CLOACINA_HOME") or "~/.cloacina"
    return Path(home).expanduser() / "agent-cache"


def split_list(raw: str | None) -> tuple[str, ...]:
    """``"a, b,,c"`` → ``("a", "b", "c")``."""
    if not raw:
        return ()
    return tuple(item.strip() for item in raw.split(",") if item.strip())
