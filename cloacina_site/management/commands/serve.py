"""`manage.py serve`: daphne and the background loops in one process.

Boot order: configuration (flag > env > config.toml > default) → dispatcher
(an unknown executor key stops here, exit 2, nothing started) → migrations
(under an advisory lock, so servers starting together take turns) → desired_count
clamped to every tenant's effective limit (a lowered default) → this
process's ServerInstance row → daphne on the asyncio Twisted reactor.  Once
the reactor runs, :meth:`ServeProcess.start` starts the executor, the dispatch
loop and the periodic jobs on the same event loop, then prints the ready line.
SIGTERM/SIGINT stop intake first, hand the agents' sockets to the other replicas
(close 4012), then stop the executor, then mark the instance stopped and give
back its unfinished in-process claims.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from django.core.management.base import BaseCommand, CommandError
from django.db import close_old_connections, connection

from agents.protocol.event_loop import running_loop_kind
from agents.protocol.heap import SurvivorFreezer, freeze_startup_heap
from agents.sandbox.task_isolation import TaskUserError
from artifacts.builds.runner import BuildRunner
from cloacina_site.daphne_limits import apply_daphne_limits, close_websockets, websockets_closing
from cloacina_site.tls import PLAINTEXT_WARNING, ServerTLS, daphne_endpoint, server_tls
from cloacina_site.web_security import apply_tls_settings
from fleet.api import metrics as executor_metrics
from fleet.control import health_samples, limits, substrate
from fleet.control import jobs as control
from fleet.engine import leader, recovery, server_registry, task_logs
from fleet.engine.dispatcher import Dispatcher
from fleet.engine.events import ExecutorNotFound
from fleet.engine.executor import PeriodicJob
from fleet.engine.loop import EngineLoop
from fleet.engine.periodic import PeriodicJobs
from fleet.executors.fleet.delivery.handover import (
    AGENT_SOCKETS_PATH,
    CLOSE_GO_ELSEWHERE,
    GO_ELSEWHERE_REASON,
    HAND_OVER_WAIT_S,
)
from fleet.executors.registry import build_dispatcher
from fleet.platform import db_pool
from fleet.platform.config import Config, ConfigError, apply_overrides, parse_flag
from fleet.platform.db_errors import database_unavailable, one_line
from fleet.platform.isolation import current_warning
from fleet.platform.schema import migrate_with_lock
from fleet.schedules import firing as schedule_firing

log = logging.getLogger("cloacina.serve")

STOP_TIMEOUT_S = 30.0  # the executor's own drain must finish within this on SIGTERM
# Connections the kernel queues for the server before it accepts them (Twisted's default
# is 50; the kernel caps it at net.core.somaxconn).  Thousands of agents registering or
# deregistering at once overflowed 50: their connections were reset and retried.
LISTEN_BACKLOG = 1024
EXIT_CONFIG = 2


class Command(BaseCommand):
    help = "Run the Cloacina server: daphne (HTTP, WebSocket) and the background loops."
    requires_system_checks: list[str] = []  # checked explicitly after the configuration

    def add_arguments(self, parser) -> None:
        parser.add_argument("--host", default="127.0.0.1", help="interface to listen on")
        parser.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port)")
        parser.add_argument(
            "--default-executor",
            dest="default_executor",
            default=None,
            help="executor key every task goes to (default | fleet | a key of [executors])",
        )
        parser.add_argument(
            "--actuator", default=None, help=f"fleet actuator: {' | '.join(substrate.ACTUATORS)}"
        )
        # Strings here, checked by the config's own parser: a bad value is one line, exit 2.
        parser.add_argument(
            "--agent-heartbeat-interval-s",
            dest="agent_heartbeat_interval_s",
            default=None,
            help="heartbeat interval advertised to agents, seconds (>= 0.05)",
        )
        parser.add_argument(
            "--agent-liveness-misses",
            dest="agent_liveness_misses",
            default=None,
            help="missed beats before an agent is declared dead (>= 1)",
        )
        parser.add_argument("--tls-cert", default=None, help="PEM certificate (chain): serve TLS")
        parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
        parser.add_argument(
            "--tls-client-ca",
            default=None,
            help="PEM CA(s): require client certificates signed by it (mutual TLS)",
        )

    def handle(self, *args, **options) -> None:
        config = self._configure(options)
        try:
            tls = server_tls(config)  # bad paths, a mismatched key, … stop here: exit 2
        except ConfigError as exc:
            raise CommandError(str(exc), returncode=EXIT_CONFIG) from None
        # Secure cookies and HSTS follow --tls-cert too, not only CLOACINA_TLS_CERT.
        apply_tls_settings(tls is not None, config.hsts_seconds)
        instance_id = server_registry.new_instance_id()
        try:
            dispatcher = build_dispatcher(config, claimer=instance_id)
        except (ExecutorNotFound, TaskUserError, ConfigError) as exc:
            raise CommandError(str(exc), returncode=EXIT_CONFIG) from None
        executor_metrics.watch_executors(dispatcher)  # every registered one, on /metrics
        try:
            # The actuator's substrate guard: a missing Docker daemon, cluster, … stops the boot.
            control.build_actuator(config)
        except ConfigError as exc:
            raise CommandError(str(exc), returncode=EXIT_CONFIG) from None
        self.check(display_num_errors=False)
        if tls is None:  # once the configuration is known good, so a refusal stays one line
            sys.stderr.write(PLAINTEXT_WARNING + "\n")
            sys.stderr.flush()
        migrate_with_lock()
        # A limit lowered while the server was down (a smaller CLOACINA_DEFAULT_MAX_AGENTS)
        # pulls desired_count down before any loop acts on it.
        limits.clamp_to_limits(config.default_max_agents)
        warn_if_not_isolated()
        server_registry.register_instance(instance_id, config.default_executor)
        connection.close()  # the main thread hands over to the reactor; threads use their own
        process = ServeProcess(
            config, dispatcher, instance_id, options["host"], options["port"], self.stdout, tls
        )
        code = process.run()
        if code:
            sys.exit(code)

    def _configure(self, options: dict) -> Config:
        actuator = options["actuator"]
        try:
            heartbeat_s = server_registry.heartbeat_interval_s()
            config = apply_overrides(
                default_executor=options["default_executor"],
                fleet_actuator=actuator,
                tls_cert=options["tls_cert"],
                tls_key=options["tls_key"],
                tls_client_ca=options["tls_client_ca"],
                heartbeat_interval_s=parse_flag(
                    "heartbeat_interval_s",
                    options.get("agent_heartbeat_interval_s"),
                    "--agent-heartbeat-interval-s",
                ),
                liveness_misses=parse_flag(
                    "liveness_misses",
                    options.get("agent_liveness_misses"),
                    "--agent-liveness-misses",
                ),
            )
        except ConfigError as exc:
            raise CommandError(str(exc), returncode=EXIT_CONFIG) from None
        if not 0 <= options["port"] <= 65535:
            raise CommandError(f"--port must be 0..65535, got {options['port']}", returncode=2)
        log.debug("server heartbeat every %.1fs", heartbeat_s)
        return config


class ServeProcess:
    """The running server: daphne plus executor, dispatch loop and periodic jobs."""

    def __init__(
        self,
        config: Config,
        dispatcher: Dispatcher,
        instance_id: str,
        host: str,
        port: int,
        stdout,
        tls: ServerTLS | None = None,
    ) -> None:
        self.config = config
        self.dispatcher = dispatcher
        self.instance_id = instance_id
        self.host = host
        self.port = port
        self.stdout = stdout
        self.tls = tls
        self.scheme = "https" if tls is not None else "http"
        self.exit_code = 0
        self.engine = None
        self.jobs = None
        self.builds = None
        self._executor_started = False
        self._stopping = False
        self._ready = False
        self._stopped = False

    def run(self) -> int:
        # daphne.server installs the asyncio Twisted reactor on import; it must come first
        # (before Twisted's reactor, and before cloacina_site.daphne_server, which subclasses
        # its Server).
        import daphne.server  # noqa: F401
        from twisted.internet import reactor

        # A local import: the ASGI app reads the settings as it is built, and handle() has
        # only now finished adjusting them (TLS, overrides); the reactor is installed above.
        from cloacina_site.asgi import application
        from cloacina_site.daphne_server import FleetServer  # local: after the reactor

        apply_daphne_limits(self.config.max_request_bytes, self.config.http_keepalive_s)
        self.server = FleetServer(
            application=application,
            endpoints=[
                daphne_endpoint(self.tls, self.host, self.port, LISTEN_BACKLOG)
                if self.tls is not None
                else f"tcp:port={self.port}:backlog={LISTEN_BACKLOG}:interface={self.host}"
            ],
            signal_handlers=True,
        )
        reactor.callWhenRunning(self._start)
        reactor.addSystemEventTrigger("before", "shutdown", self._shutdown)
        self.server.run()
        if not self._ready:
            # Never got to serve (e.g. the port is taken: daphne aborts before the reactor
            # runs, so no shutdown trigger fired).  Say so, and leave no live instance row.
            if not self.server.listening_addresses:
                sys.stderr.write(f"serve: could not listen on {self.host}:{self.port}\n")
            self.exit_code = self.exit_code or 1
            if not self._stopped:
                _db_call(recovery.shutdown_cleanup, self.instance_id)
        return self.exit_code

    # -- start -------------------------------------------------------------------------
    def _start(self) -> None:
        task = asyncio.ensure_future(self._start_async())
        task.add_done_callback(self._started)

    def _started(self, task: asyncio.Future) -> None:
        if task.cancelled() or task.exception() is None:
            return
        log.error("server failed to start", exc_info=task.exception())
        self._fail(1)

    def _fail(self, code: int) -> None:
        from twisted.internet import reactor

        self.exit_code = code
        if reactor.running:
            reactor.stop()

    async def _start_async(self) -> None:
        executor = self.dispatcher.executor
        # Chosen by manage.py before Django loaded (the "daphne" app makes the loop on import).
        log.info("event loop: %s", running_loop_kind(asyncio.get_running_loop()))
        await executor.start()
        self._executor_started = True
        self.engine = EngineLoop(self.dispatcher, self.config.scheduler_poll_s)
        await self.engine.start()
        self.builds = BuildRunner(self.instance_id, self.config)
        self.jobs = PeriodicJobs(self._periodic_jobs(executor.periodic_jobs()))
        self.jobs.start()
        port = await self._listening_port()
        if port is None:
            self._fail(1)  # daphne already logged the listen failure
            return
        await asyncio.get_running_loop().run_in_executor(
            None, _db_call, server_registry.set_port, self.instance_id, port
        )
        # Agents the process actuator starts connect back here.
        local = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        control.bind_server_url(f"{self.scheme}://{local}:{port}")
        self.stdout.write(
            f"Cloacina server ready: console at {self.scheme}://{self.host}:{port}/console/ "
            f"(executor: {executor.key})"
        )
        self.stdout.flush()
        self._ready = True
        # Everything loaded so far lives as long as the process: no full collection needs
        # to walk it again (agents/protocol/heap.py: the p99 it cost an idle pickup).
        log.debug("froze %d startup objects", freeze_startup_heap())
        # And what each full collection finds alive from now on: a connect storm's sockets are
        # walked once, not by every full collection while the heap grows (heap.py).
        SurvivorFreezer().install()

    def _periodic_jobs(self, executor_jobs: list[PeriodicJob]) -> list[PeriodicJob]:
        instance_id = self.instance_id
        return [
            PeriodicJob(
                "server_heartbeat",
                lambda: server_registry.beat(instance_id),
                server_registry.heartbeat_interval_s(),
            ),
            *recovery.recovery_jobs(),
            *task_logs.task_log_jobs(),
            *control.control_plane_jobs(self.config),
            *health_samples.health_sample_jobs(),
            *schedule_firing.schedule_jobs(self.config.schedule_tick_s),
            *(self.builds.periodic_jobs() if self.builds is not None else []),
            *executor_jobs,
        ]

    async def _listening_port(self) -> int | None:
        from twisted.internet import defer

        await defer.DeferredList(self.server.listeners).asFuture(asyncio.get_running_loop())
        if not self.server.listening_addresses:
            return None
        return int(self.server.listening_addresses[0][1])

    # -- stop --------------------------------------------------------------------------
    def _shutdown(self):
        """Twisted 'before shutdown' trigger: the reactor waits for the returned Deferred."""
        from twisted.internet import defer

        if self._stopping:
            return None
        self._stopping = True
        self._hand_over_agents()  # now: daphne's own trigger, next, cancels the consumers
        return defer.Deferred.fromFuture(asyncio.ensure_future(self._stop_async()))

    def _hand_over_agents(self) -> None:
        """Send every agent connected here to another replica (close 4012), at once."""
        if not self._executor_started:
            return
        try:
            self.dispatcher.executor.hand_over()
            closed = close_websockets(
                self.server, AGENT_SOCKETS_PATH, CLOSE_GO_ELSEWHERE, GO_ELSEWHERE_REASON
            )
        except Exception:
            log.exception("the agents were not handed over cleanly")
            return
        if closed:
            log.info("sent %d agent(s) to the other servers (close %d)", closed, CLOSE_GO_ELSEWHERE)

    async def _agents_gone(self) -> None:
        """Wait (a little) for the agents' sockets to finish closing: their close frames
        must leave before the process does."""
        deadline = asyncio.get_running_loop().time() + HAND_OVER_WAIT_S
        while websockets_closing(self.server, AGENT_SOCKETS_PATH):
            if asyncio.get_running_loop().time() >= deadline:
                return
            await asyncio.sleep(0.05)

    async def _stop_async(self) -> None:
        loop = asyncio.get_running_loop()
        db_pool.shorten_checkout()  # a database that is gone fails each step below fast
        if self.engine is not None:
            self.engine.stop_accepting()
        await self._agents_gone()
        if self.jobs is not None:
            self.jobs.stop()
        if self.builds is not None:
            try:  # kills running pips; their builds go back to the queue for another server
                released = await loop.run_in_executor(None, self.builds.stop)
                if released:
                    log.info("queued %d unfinished build(s) again on shutdown", released)
            except Exception as exc:
                _shutdown_step_failed("the package builds did not stop cleanly", exc)
        if self._executor_started:
            try:
                await asyncio.wait_for(self.dispatcher.executor.stop(), STOP_TIMEOUT_S)
            except Exception as exc:
                _shutdown_step_failed("executor did not stop cleanly", exc)
        try:
            await loop.run_in_executor(None, control.shutdown)  # agents it started, leadership
        except Exception as exc:
            _shutdown_step_failed("the fleet control plane did not shut down cleanly", exc)
        if self.engine is not None:
            await self.engine.stop()
        try:
            released = await loop.run_in_executor(
                None, _db_call, recovery.shutdown_cleanup, self.instance_id
            )
            if released:
                log.info("released %d unfinished claim(s) on shutdown", released)
        except Exception as exc:
            _shutdown_step_failed(f"could not mark server {self.instance_id} stopped", exc)
        leader.close_all()
        db_pool.close_pool()  # wakes borrowers still waiting, so the process can exit
        self._stopped = True
        log.info("server %s stopped", self.instance_id)


def _shutdown_step_failed(what: str, exc: BaseException) -> None:
    """Log a shutdown step that failed: one line when the database is gone (every step fails
    the same way then, and the traceback says nothing), the traceback otherwise."""
    if database_unavailable(exc):
        log.warning("%s: database unavailable (%s)", what, one_line(exc))
    else:
        log.error("%s", what, exc_info=exc)


def warn_if_not_isolated() -> None:
    """One line on stderr when tenants' tasks cannot be kept from the server's secrets."""
    warning = current_warning()
    if warning:
        sys.stderr.write(f"serve: {warning}\n")
        sys.stderr.flush()


def _db_call(func, *args):
    close_old_connections()
    try:
        return func(*args)
    finally:
        close_old_connections()
