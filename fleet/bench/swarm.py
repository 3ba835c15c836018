"""Many simulated agents in one process: the swarm behind ``fleetbench --simulated-agents``.

Each simulated agent IS the runtime's :class:`agents.runtime.agent.Agent` — its
registration (429 Retry-After honoured with jitter), its delivery socket and hello,
its ``received`` confirmations, its heartbeat loop, its outcome reporter (``result``
frames answered by ``result_ack``, REST when the socket cannot), its reconnects and
its drain — so the protocol is written once.  Only what would make thousands of them
in one process expensive or slow is swapped:

* the task runner answers every packet at once with a no-op success (no child process);
* the package cache never fetches the artifact (nothing runs it);
* host metrics are read once for the whole swarm, not on every beat of every agent;
* each agent's REST client keeps at most a few connections (``AGENT_HTTP_CONNECTIONS``).

Each agent has a client and a connection pool of its own, as a real agent does.  One pool
shared by all of them (an earlier version) queued every agent's requests in one list: when
a dispatch made thousands of agents post results over REST at once (result acks late on a
loaded server), httpcore's pool rescanned its whole queue against every connection on each
answer, the swarm's event loop spent its time there, no agent sent a heartbeat, and the
server evicted them all — the swarm, not the server, collapsed.

The swarm runs on an event loop of its own in a background thread, so the benchmark's
main thread keeps its synchronous database connection for measuring.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import shutil
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from agents.protocol.triples import host_triple
from agents.runtime import host_metrics
from agents.runtime.agent import EXIT_OK, Agent
from agents.runtime.agent_config import AgentConfig
from agents.runtime.client import AgentClient
from agents.sandbox.task_log import LogRing
from agents.sandbox.task_runner import RunOutcome

log = logging.getLogger(__name__)

# Registrations in flight at once: the swarm starts a new agent when one of these is
# answered, so thousands of agents do not all wait for the server at once.
REGISTERING_AT_ONCE = 64
# REST connections of one simulated agent: its registration, beats while the socket is
# down and results without an ack, side by side.  With its delivery socket, the open files
# the swarm needs per agent (FILES_PER_AGENT): 5,000 agents must fit a 20,000 limit.
AGENT_HTTP_CONNECTIONS = 2
FILES_PER_AGENT = 1 + AGENT_HTTP_CONNECTIONS
ADMIT_POLL_S = 0.01
DRAINING_AT_ONCE = 64  # agents draining (and deregistering) at once at the end
# Every this many agents started, the objects alive then (the agents, their sockets and
# sessions: they live as long as the swarm) leave the cyclic collector's generations
# (gc.freeze).  Its full collections otherwise walk every agent again and again while
# thousands connect: a fifth of the swarm's CPU per connecting agent at 1,000 agents.
FREEZE_EVERY = 256
STOP_TIMEOUT_S = 120.0  # the least a drain is given
# Agents drained per second a drain's timeout allows for beyond that: each deregisters over
# a REST call of its own, thousands at once (5,000 agents were still draining after 120 s).
DRAIN_FLOOR_PER_S = 10.0


@dataclass(frozen=True)
class SwarmKey:
    """An agent key of one tenant and how many simulated agents register with it."""

    tenant: str
    token: str
    agents: int


@dataclass(frozen=True)
class SwarmCounts:
    started: int
    registered: int
    connected: int
    exited: int
    failed: int  # exited with anything but a clean drain
    runs: int  # packets the simulated agents "ran"


class NoopRunner:
    """The task runner's interface (agents/sandbox/task_runner.py), answering at once."""

    def __init__(self) -> None:
        self.runs = 0

    def require_reachable(self, path: Path, what: str) -> None:
        """Nothing runs under a task user here, so every path is reachable."""

    def start(self) -> None:
        """No child processes to start."""

    def close(self) -> None:
        """No child processes to stop."""

    def new_log(self) -> LogRing:
        """A no-op prints nothing: the smallest ring the agent can tail."""
        return LogRing(1)

    async def run(
        self,
        package_dir: Path,
        function: str,
        context_json: str,
        timeout_s: float,
        log: LogRing | None = None,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> RunOutcome:
        self.runs += 1
        return RunOutcome("success", {}, duration_s=0.0, output_bytes=2)


class NoFetchCache:
    """The package cache's interface (agents/sandbox/package_cache.py) for agents that
    never run the package: no fetch, no extraction, one shared placeholder path."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def pin(self, digest: str) -> None:
        """Nothing is ever evicted."""

    def unpin(self, digest: str) -> None:
        """Nothing is ever evicted."""

    def release_idle_pins(self, everything: bool = False) -> None:
        """Nothing is ever pinned."""

    async def aget(self, digest: str, fetch: Any) -> Path:
        return self.root


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One TLS context for every simulated agent's pool.  httpx builds a new one per
    transport otherwise (loading the system's CA bundle: tens of milliseconds), and that
    was three quarters of the swarm's CPU while connecting: the swarm, not the server,
    set the registration rate.  Unused for plain http://; shared, as its settings are."""
    return httpx.create_ssl_context()


def _agent_transport() -> httpx.AsyncHTTPTransport:
    """One simulated agent's connection pool (see the module docstring)."""
    limits = httpx.Limits(
        max_connections=AGENT_HTTP_CONNECTIONS, max_keepalive_connections=AGENT_HTTP_CONNECTIONS
    )
    return httpx.AsyncHTTPTransport(limits=limits, verify=_ssl_context())


def stop_timeout_s(agents: int) -> float:
    """How long a drain of ``agents`` may take: STOP_TIMEOUT_S, or DRAIN_FLOOR_PER_S."""
    return max(STOP_TIMEOUT_S, agents / DRAIN_FLOOR_PER_S)


class Swarm:
    """``keys``' agents, started in the background by :meth:`start`, drained by :meth:`stop`."""

    def __init__(
        self,
        server_url: str,
        keys: list[SwarmKey],
        slots: int = 16,
        registering_at_once: int = REGISTERING_AT_ONCE,
    ) -> None:
        self.server_url = server_url
        self.keys = keys
        self.slots = slots
        self.registering_at_once = registering_at_once
        self.runner = NoopRunner()
        self.agents: list[Agent] = []
        self.exit_codes: list[int] = []
        self.started_at = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._first_pending = 0  # index of the oldest agent that may still be registering
        self._main_task: asyncio.Task | None = None
        self._drainer: asyncio.Future | None = None  # drain_in_waves, once stop() asked
        self._cancelled = False
        self._cache_root = Path(tempfile.mkdtemp(prefix="cloacina-swarm-"))

    @property
    def size(self) -> int:
        return sum(key.agents for key in self.keys)

    # -- control, from the benchmark's thread ---------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="swarm", daemon=True)
        self._thread.start()
        self._ready.wait()

    def counts(self) -> SwarmCounts:
        """A snapshot (attribute reads: safe across threads for counting)."""
        agents = list(self.agents)
        return SwarmCounts(
            started=len(agents),
            registered=sum(a.registration is not None for a in agents),
            connected=sum(a.session is not None for a in agents),
            exited=len(self.exit_codes),
            failed=sum(code != EXIT_OK for code in self.exit_codes),
            runs=self.runner.runs,
        )

    def check(self) -> None:
        """Raise what stopped the swarm's loop, if anything did."""
        if self._error is not None:
            raise RuntimeError(f"the swarm stopped: {self._error!r}") from self._error

    def stop(self, timeout_s: float | None = None, drain: bool = True) -> None:
        """Drain every agent (each deregisters) and wait for the swarm's thread to end, at
        most ``timeout_s`` (default: :func:`stop_timeout_s` of the swarm's size).
        ``drain=False`` instead cancels every agent at once, as a kill would: nothing is
        reported or deregistered (for a bench that drops the server and its database
        next, and must not have a thousand drains retrying in its process meanwhile)."""
        if self._loop is None or self._thread is None:
            return
        if timeout_s is None:
            timeout_s = stop_timeout_s(self.size)
        with contextlib.suppress(RuntimeError):  # the loop already ended
            self._loop.call_soon_threadsafe(self._drain_all if drain else self._cancel_all)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("swarm: agents still draining after %.0fs; leaving them", timeout_s)

    # -- the swarm's own thread -----------------------------------------------------------
    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except asyncio.CancelledError:
            if not self._cancelled:  # stop(drain=False) is how the swarm ends, not an error
                raise
        except BaseException as exc:  # reported through check(); the thread must not die silently
            self._error = exc
            self._ready.set()

    async def _run(self) -> None:
        self._main_task = asyncio.current_task()
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self._ready.set()
        clients: list[AgentClient] = []
        reading = host_metrics.sample()
        triple = host_triple()
        runs: list[asyncio.Task] = []
        self.started_at = time.time()
        try:
            for config in self._configs(triple):
                while (
                    not self._stopping.is_set() and self._registering() >= self.registering_at_once
                ):
                    await asyncio.sleep(ADMIT_POLL_S)
                if self._stopping.is_set():
                    break
                client = AgentClient(self.server_url, config.api_key, transport=_agent_transport())
                clients.append(client)
                agent = Agent(
                    config,
                    runner=self.runner,
                    cache=NoFetchCache(self._cache_root),
                    client=client,
                    metrics=lambda: reading,
                )
                self.agents.append(agent)
                runs.append(asyncio.create_task(self._run_agent(agent)))
                if len(runs) % FREEZE_EVERY == 0:
                    gc.freeze()
            await asyncio.gather(*runs)
        finally:
            gc.unfreeze()  # what the agents leave behind is garbage again
            for task in runs:
                task.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            for client in clients:
                await client.close()  # closes its transport too
            shutil.rmtree(self._cache_root, ignore_errors=True)

    def _configs(self, triple: str):
        for key_index, key in enumerate(self.keys):
            for i in range(key.agents):
                yield AgentConfig(
                    server_url=self.server_url,
                    api_key=key.token,
                    name=f"{key.tenant}-{key_index:03d}-{i:05d}",
                    target_triple=triple,
                    cache_dir=self._cache_root,
                    cache_max_bytes=0,
                    max_concurrency=self.slots,
                )

    def _registering(self) -> int:
        """Agents started that hold no first registration yet (nor have stopped).  Agents
        register roughly in the order they start: only the tail past the oldest one still
        registering is scanned, not every agent on every poll."""
        agents = self.agents
        while self._first_pending < len(agents) and self._settled(agents[self._first_pending]):
            self._first_pending += 1
        return sum(not self._settled(a) for a in agents[self._first_pending :])

    @staticmethod
    def _settled(agent: Agent) -> bool:
        return agent.registration is not None or agent.exit_code is not None

    async def _run_agent(self, agent: Agent) -> None:
        code = await agent.run()
        self.exit_codes.append(code)

    def _cancel_all(self) -> None:
        self._stopping.set()
        self._cancelled = True
        if self._main_task is not None:
            self._main_task.cancel()  # its finally cancels every agent and closes the clients

    def _drain_all(self) -> None:
        self._stopping.set()
        self._drainer = asyncio.ensure_future(self.drain_in_waves())

    async def drain_in_waves(self, at_once: int = DRAINING_AT_ONCE) -> None:
        """Drain the agents ``at_once`` at a time, the next as one exits.  Each drain ends
        in a deregistration over a new REST connection: 5,000 at once saturated the swarm's
        own loop, their connects timed out and were retried, and none got through in 120 s."""
        draining: list[Agent] = []
        for agent in list(self.agents):
            while len(draining) >= at_once:
                draining = [a for a in draining if a.exit_code is None]
                if len(draining) >= at_once:
                    await asyncio.sleep(ADMIT_POLL_S)
            agent.request_drain("the benchmark is over")
            draining.append(agent)
