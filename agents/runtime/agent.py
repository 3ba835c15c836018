"""The DB-less execution agent behind ``manage.py runagent`` (docs/agent.md).

One asyncio loop runs three things: the connection loop (register on the delivery
WebSocket, or over REST on an older server; hold the socket, reconnect with backoff,
re-register when the server forgot us), the heartbeat loop, and one coroutine per work packet (triple check →
artifact from the cache → the task in a child process → outcome posted until the
server has it).  A drain (SIGTERM/SIGINT or a ``drain`` frame) refuses new packets,
waits for everything in hand to be reported, deregisters and exits 0.

Imports no Django model and opens no database connection (tests prove it).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from agents.protocol import frames, wire
from agents.runtime import host_metrics
from agents.runtime.agent_config import AGENT_VERSION, AgentConfig
from agents.runtime.backoff import (
    RATE_LIMITED_BASE_S,
    RATE_LIMITED_CAP_S,
    Backoff,
    move_delay,
    rate_limited_delay,
    wait_event,
)
from agents.runtime.client import (
    AgentClient,
    AuthRejected,
    ProtocolMismatch,
    RateLimited,
    Registration,
    RequestRejected,
    ServerUnavailable,
    TLSFailure,
    UnknownAgent,
    websocket_url,
)
from agents.runtime.connection import Action, Session, SessionEnd, ping_interval_s, run_session
from agents.runtime.heartbeat import BeatBody, BeatTarget, HeartbeatLoop
from agents.runtime.socket_registration import NotOnSocket, register_on_socket
from agents.runtime.work_intake import WorkIntake
from agents.sandbox.package_cache import TOUCH_INTERVAL_S, PackageCache
from agents.sandbox.task_runner import TaskRunner

log = logging.getLogger("cloacina.agent")

EXIT_OK = 0
EXIT_FORCED = 1  # a second signal during a drain: in-flight work was abandoned
EXIT_CONFIG = 2  # the server refused our registration as malformed or incompatible
EXIT_AUTH = 3  # the API key is bad, revoked or not an agent key

DEREGISTER_ATTEMPTS = 5
# A session that stayed open this long was healthy: the next reconnect starts from scratch.
STABLE_SESSION_S = 10.0
UNREGISTERED_BEAT_S = 1.0


class Agent:
    def __init__(
        self,
        config: AgentConfig,
        runner: TaskRunner | None = None,
        cache: PackageCache | None = None,
        client: AgentClient | None = None,
        metrics: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.config = config
        # A client handed in may be shared (the bench's simulated agents share one per key):
        # only the one made here is closed when the agent stops.
        self._owns_client = client is None
        self.client = client or AgentClient(config.server_urls, config.api_key, tls=config.tls)
        # What registrations and beats say about the host; the bench's simulated agents,
        # thousands in one process, pass one reading instead of sampling the host each beat.
        self.metrics = metrics or host_metrics.sample
        # Pins kept a second after a task (one flock per package, not per task); each beat
        # lets go of those kept longer (_beat_body).
        self.cache = cache or PackageCache(
            config.cache_dir, config.cache_max_bytes, pin_linger_s=TOUCH_INTERVAL_S
        )
        self.runner = runner or TaskRunner(config.max_concurrency)
        self.registration: Registration | None = None
        # This process's id, the same in every registration it makes: an outcome it owes
        # under an earlier agent id counts for the current one (docs/agent-protocol.md).
        self.instance_id = str(uuid.uuid4())
        self.session: Session | None = None
        # The socket the agent just registered on, until its session takes it over.
        self._registered_socket: ClientConnection | None = None
        # Servers that refused a registering socket (older ones): they register over REST.
        self._rest_only: set[str] = set()
        self.draining = False
        self.exit_code: int | None = None
        self.exit_message = ""
        self._stopping = False
        self._stop = asyncio.Event()
        self._wake_connection = asyncio.Event()
        self._drain_task: asyncio.Task | None = None
        self.intake = WorkIntake(
            self.client,
            self.cache,
            self.runner,
            config.target_triple,
            config.max_concurrency,
            self._send_soon,
            self._auth_rejected,
            self._result_socket,
            self._send_log,
        )
        self.heartbeat = HeartbeatLoop(
            self.client,
            self._beat_target,
            self._beat_body,
            self._forget_registration,
            lambda: self.request_drain("the server asked this agent to drain"),
            self._auth_rejected,
        )

    # -- lifecycle ----------------------------------------------------------

    async def run(self) -> int:
        """Run until drained (0) or stopped by a fatal condition; returns the exit code."""
        c = self.config
        log.info(
            "agent %s starting: server %s, %s, %d slot(s), cache %s",
            c.name, ", ".join(c.server_urls), c.target_triple, c.max_concurrency, c.cache_dir,
        )  # fmt: skip
        if self.client.ssl_context is not None:
            log.info("%s", c.tls.describe())
        self.metrics()  # primes cpu_percent, whose first reading is meaningless
        self.runner.require_reachable(self.cache.root, "the package cache")
        await asyncio.to_thread(self.runner.start)
        loops = [
            asyncio.create_task(self._connection_loop(), name="connection"),
            asyncio.create_task(self.heartbeat.run(), name="heartbeat"),
        ]
        try:
            await self._stop.wait()
        finally:
            self._stopping = True
            await self._stop_loops(loops)
        if self.exit_code == EXIT_OK:
            log.info("agent %s stopped: %s", self.config.name, self.exit_message)
        else:
            log.error("agent %s stopped: %s", self.config.name, self.exit_message)
        return self.exit_code if self.exit_code is not None else EXIT_FORCED

    async def _stop_loops(self, loops: list[asyncio.Task]) -> None:
        """Close the socket, then stop the loops, the intake, the runner and the client.
        Each step runs even when an earlier one raises or is cancelled (a swarm cancelling
        its agents cancels this too): a heartbeat loop left running would outlive the HTTP
        client and fail on a closed one ("Task exception was never retrieved")."""
        try:
            if self.session is not None:
                await self.session.close("agent stopping")
            if self._registered_socket is not None:
                await self._registered_socket.close()
        finally:
            for task in loops:
                task.cancel()
            try:
                await asyncio.gather(*loops, return_exceptions=True)
            finally:
                try:
                    await self.intake.cancel_all()
                    await asyncio.to_thread(self.runner.close)
                finally:
                    if self._owns_client:
                        await self.client.close()

    def request_drain(self, reason: str) -> None:
        """Stop taking work, finish and report what is in hand, deregister, exit 0."""
        if self.draining:
            return
        self.draining = self.intake.draining = True
        log.info("draining (%s): %d task(s) in hand", reason, len(self.intake.held))
        self.heartbeat.beat_now()  # tell the server at once that we take no more work
        self._wake_connection.set()
        self._drain_task = asyncio.create_task(self._drain(), name="drain")

    def on_signal(self, name: str) -> None:
        """First SIGTERM/SIGINT drains; a second one stops at once."""
        if not self.draining:
            self.request_drain(f"received {name}")
        else:
            log.warning("received %s again: stopping without waiting for in-flight work", name)
            self._finish(
                EXIT_FORCED,
                f"stopped by a second {name} with {len(self.intake.held)} task(s) unreported",
            )

    def _finish(self, code: int, message: str) -> None:
        if self.exit_code is None:
            self.exit_code, self.exit_message = code, message
        self._stop.set()

    def _auth_rejected(self, exc: AuthRejected) -> None:
        self._finish(EXIT_AUTH, str(exc))

    async def _drain(self) -> None:
        await self.intake.idle.wait()
        registration = self.registration
        if registration is None:
            self._finish(EXIT_OK, "drained (not registered: nothing to deregister)")
        elif await self._deregister(registration.agent_id):
            self._finish(EXIT_OK, "drained and deregistered")
        else:
            self._finish(EXIT_OK, "drained; the server's liveness sweep will retire this agent")

    async def _deregister(self, agent_id: str) -> bool:
        """Whether the server now counts the agent as gone (deregistered or already dead)."""
        backoff = Backoff()
        for _ in range(DEREGISTER_ATTEMPTS):
            try:
                await self.client.deregister(agent_id)
                log.info("deregistered agent %s", agent_id)
                return True
            except UnknownAgent:
                return True  # already dead to the server: nothing to undo
            except ServerUnavailable as exc:
                log.warning("deregistration failed (%s); retrying", exc)
                await asyncio.sleep(backoff.next_delay())
            except (AuthRejected, RequestRejected) as exc:
                log.warning("deregistration refused: %s", exc)
                return False
        log.warning("giving up deregistration of agent %s", agent_id)
        return False

    # -- registration and the delivery socket -----------------------------------

    def _registration_body(self, wire_format: str) -> dict[str, Any]:
        c = self.config
        return {
            "name": c.name,
            "target_triple": c.target_triple,
            "max_concurrency": c.max_concurrency,
            "version": AGENT_VERSION,
            "protocol_version": c.protocol_version,
            "wire_format": wire_format,
            "tags": list(c.tags),
            "capabilities": list(c.capabilities),
            "exclusive": c.exclusive,
            "metrics": self.metrics(),
            "instance_id": self.instance_id,
        }

    async def _register(self) -> bool:
        """Register (retrying while the server is unreachable); False when we should not."""
        backoff = Backoff()
        limited = Backoff(RATE_LIMITED_BASE_S, RATE_LIMITED_CAP_S)
        wire_format, other_tried = self.config.wire_format, False
        while not self._stopping:
            if self.draining:
                return False  # a draining agent takes no new identity: it only reports
            try:
                registration = await self._register_once(self._registration_body(wire_format))
            except TLSFailure as exc:  # a certificate or CA mismatch does not pass by waiting
                self._finish(EXIT_CONFIG, f"cannot register: {exc}")
                return False
            except ServerUnavailable as exc:
                delay = backoff.next_delay()
                log.warning("cannot register (%s); retrying in %.1fs", exc, delay)
                await self._sleep_or_wake(delay)
                continue
            except RateLimited as exc:
                # Too many registrations or agents for now: it passes, so wait (as long as
                # the server asks, within the cap) and keep trying while the process runs.
                delay = rate_limited_delay(limited, exc.retry_after_s)
                log.warning("%s; retrying in %.1fs", exc, delay)
                await self._sleep_or_wake(delay)
                continue
            except AuthRejected as exc:
                self._finish(EXIT_AUTH, str(exc))
                return False
            except ProtocolMismatch as exc:
                if not other_tried:  # the server may simply speak the other wire format
                    other_tried = True
                    wire_format = "msgpack" if wire_format == "json" else "json"
                    continue
                self._finish(EXIT_CONFIG, f"the server refused the registration: {exc}")
                return False
            except RequestRejected as exc:
                self._finish(EXIT_CONFIG, str(exc))
                return False
            self.registration = registration
            log.info(
                "registered as %s (agent id %s, %s, %d slot(s), heartbeat every %gs)",
                registration.name,
                registration.agent_id,
                self.config.target_triple,
                self.config.max_concurrency,
                registration.heartbeat_interval_s,
            )
            return True
        return False

    async def _register_once(self, body: dict[str, Any]) -> Registration:
        """One registration: on the delivery socket where the server has it (the socket is
        kept for the session), else over REST.  Either raises the REST client's errors."""
        server = self.client.server_url
        if self.config.register_on_socket and server not in self._rest_only:
            try:
                socket, registration = await register_on_socket(
                    server, self.config.api_key, body, self.client.ssl_context
                )
            except NotOnSocket as exc:
                if exc.older_server:
                    self._rest_only.add(server)
                    log.info(
                        "%s has no registering socket (%s): registering over REST", server, exc
                    )
            except ServerUnavailable:
                self.client.fail_over(server)  # as a REST call that got no answer
                raise
            else:
                self._registered_socket = socket
                return registration
        return await self.client.register(body)

    def _forget_registration(self, agent_id: str) -> None:
        """The server no longer knows ``agent_id``: register afresh (once, however many notice)."""
        if self.registration is None or self.registration.agent_id != agent_id:
            return
        self.registration = None
        if self.session is not None:
            asyncio.create_task(self.session.close("re-registering"))
        self._wake_connection.set()

    async def _sleep_or_wake(self, delay: float) -> None:
        await wait_event(self._wake_connection, delay)
        self._wake_connection.clear()

    async def _connection_loop(self) -> None:
        backoff = Backoff()
        limited = Backoff(RATE_LIMITED_BASE_S, RATE_LIMITED_CAP_S)
        loop = asyncio.get_running_loop()
        while not self._stopping:
            if self.registration is None and not await self._register():
                return
            registration = self.registration
            server = self.client.server_url
            started = loop.time()
            end = await run_session(
                websocket_url(server, registration.ws_path),
                self.config.api_key,
                registration.wire_format,
                self._on_open,
                lambda frame, agent_id=registration.agent_id: self._on_frame(frame, agent_id),
                self._on_session_closed,
                self.client.ssl_context,
                registration.batch_frames,
                ping_interval_s(registration.heartbeat_interval_s, registration.liveness_misses),
                self._take_registered_socket(),
            )
            if self._stopping:
                return
            if end.opened and loop.time() - started >= STABLE_SESSION_S:
                backoff.reset()
                limited.reset()
            if end.action is Action.CLOSED_BY_US:
                continue  # closed to re-register: straight back round the loop
            if end.action is Action.AUTH_FAILED:
                self._finish(EXIT_AUTH, f"the server refused the agent's key: {end.detail}")
                return
            if end.action is Action.REREGISTER:
                if self.draining:
                    # Leaving anyway: its own deregistration (whose close can come before
                    # the answer) or an eviction.  Registering again would leave a new
                    # agent behind; the drain ends the process.
                    log.info("%s: the server has let this draining agent go", end.detail)
                    return
                log.warning("%s: the server no longer knows this agent", end.detail)
                self._forget_registration(registration.agent_id)
                continue
            if end.action is Action.DIAGNOSE and await self._diagnose(registration.agent_id):
                continue
            await self._sleep_or_wake(self._reconnect_delay(end, server, backoff, limited))

    def _take_registered_socket(self) -> ClientConnection | None:
        socket, self._registered_socket = self._registered_socket, None
        return socket

    def _reconnect_delay(
        self, end: SessionEnd, server: str, backoff: Backoff, limited: Backoff
    ) -> float:
        """How long to wait before the next socket, and to which server (the client's next
        one when this one stops, refused, failed or is busy)."""
        if end.action is Action.MOVE:  # the server is shutting down: elsewhere, now
            target = self.client.fail_over(server)
            delay = move_delay()
            log.info("delivery socket: %s; reconnecting to %s in %.1fs", end.detail, target, delay)
            return delay
        if end.action is Action.WAIT:  # busy: as long as it asks, with jitter
            target = self.client.fail_over(server)
            delay = rate_limited_delay(limited, end.retry_after_s)
            log.warning(
                "delivery socket: %s; reconnecting to %s in %.1fs", end.detail, target, delay
            )
            return delay
        target = self.client.fail_over(server) if end.action is Action.RECONNECT else server
        delay = backoff.next_delay()
        log.warning("delivery socket: %s; reconnecting to %s in %.1fs", end.detail, target, delay)
        return delay

    async def _diagnose(self, agent_id: str) -> bool:
        """A refused handshake does not say why; a REST heartbeat does. True: act now."""
        try:
            await self.client.heartbeat(agent_id, self._beat_body().rest())
        except UnknownAgent:
            self._forget_registration(agent_id)
            return True
        except AuthRejected as exc:
            self._finish(EXIT_AUTH, str(exc))
            return True
        except (ServerUnavailable, RequestRejected):
            pass
        return False

    async def _on_open(self, session: Session) -> None:
        self.session = session
        self.intake.reporter.server_is_back()
        holding = self.intake.holding()
        # This agent takes batch frames from any server that sends them (docs/agent-protocol.md).
        await session.send(frames.hello(holding, batch_frames=True))
        log.info("delivery socket open (holding %d task(s))", len(holding))

    def _on_session_closed(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            self.intake.reporter.socket_closed(session)

    def _result_socket(self, agent_id: str) -> Session | None:
        """The open session outcomes owed under ``agent_id`` may be reported through."""
        registration, session = self.registration, self.session
        if session is None or registration is None or not registration.result_frames:
            return None
        return session if registration.agent_id == agent_id else None

    async def _send_log(self, agent_id: str, frame: dict[str, Any]) -> None:
        """A live ``log`` frame, when the server takes them and the open socket is the
        registration the task is owed under (else dropped: the outcome carries it all)."""
        registration = self.registration
        if registration is None or not registration.log_frames:
            return
        if registration.agent_id == agent_id:
            await self._send(frame)

    async def _send(self, frame: dict[str, Any]) -> None:
        session = self.session
        if session is None:
            return
        try:
            await session.send(frame)
        except (ConnectionClosed, OSError):
            pass  # the hello of the next session tells the server what we hold

    def _send_soon(self, frame: dict[str, Any]) -> None:
        """A ``received`` confirmation: with the other frames of this loop turn (in one
        ``batch`` frame when the server takes them).  Lost with the socket, like one sent
        at once: the hello of the next session tells the server what we hold."""
        session = self.session
        if session is not None:
            session.send_soon(wire.encode(frame, session.wire_format))

    def _on_frame(self, frame: dict[str, Any], agent_id: str) -> None:
        """One frame from the server, as the socket parses it (run_session): never blocks."""
        kind = frame["type"]
        if kind == "work":
            self.intake.on_work(frame.get("packet"), agent_id)
        elif kind == "result_ack":
            self.intake.reporter.on_result_ack(frame)
        elif kind == "drain":
            self.request_drain("the server sent a drain frame")
        else:
            log.debug("ignoring a %r frame", kind)

    # -- heartbeats -------------------------------------------------------------

    def _beat_target(self) -> BeatTarget:
        registration = self.registration
        if registration is None:
            return BeatTarget(None, None, UNREGISTERED_BEAT_S)
        return BeatTarget(registration.agent_id, self.session, registration.heartbeat_interval_s)

    def _beat_body(self) -> BeatBody:
        # Once per beat: an agent with no more tasks lets other processes sharing its
        # cache evict the packages it used (the pins it kept after its last tasks).
        self.cache.release_idle_pins()
        holding = self.intake.holding()
        return BeatBody(
            in_flight=len(holding),
            running=[teid for teid, _assignment in holding],
            metrics=self.metrics(),
            draining=self.draining,
        )
