"""``manage.py runagent``: the DB-less execution agent (docs/agent.md).

manage.py sets CLOACINA_DB_LESS=1 for this command, so settings carry a
database entry that points nowhere; :func:`install_db_guard` makes sure nothing
even tries it.  The API key may come from CLOACINA_AGENT_API_KEY instead of the
command line, so an actuator need not expose it in the process list.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser

from agents.protocol.event_loop import (
    EventLoopChoiceError,
    loop_factory,
    running_loop_kind,
)
from agents.protocol.heap import freeze_startup_heap
from agents.protocol.triples import TripleError, host_triple, parse_triple
from agents.protocol.wire import ACCEPT_ANY, DEFAULT_AGENT_FORMAT, SUPPORTED_FORMATS
from agents.runtime.agent_config import (
    DEFAULT_CACHE_MAX_MB,
    DEFAULT_MAX_CONCURRENCY,
    ENV_API_KEY,
    ENV_PROTOCOL_VERSION_OVERRIDE,
    ENV_SERVER_URL,
    ENV_WIRE_FORMAT,
    PROTOCOL_VERSION,
    AgentConfig,
    default_cache_dir,
    default_name,
    split_list,
)
from agents.runtime.client import server_list
from agents.runtime.tls import (
    ENV_CA_CERT,
    ENV_CLIENT_CERT,
    ENV_CLIENT_KEY,
    AgentTLS,
    TLSConfigError,
    client_context,
)

DB_LESS_MESSAGE = "the agent is DB-less: it must never open a database connection"
LOG_FORMAT = "%(asctime)s %(levelname)s agent: %(message)s"

log = logging.getLogger("cloacina.agent")


def install_db_guard() -> None:
    """Make every attempt to connect to a database raise, whatever the settings say."""
    from django.db.backends.base.base import BaseDatabaseWrapper

    def refuse(self, *args, **kwargs):
        raise RuntimeError(DB_LESS_MESSAGE)

    BaseDatabaseWrapper.connect = refuse
    BaseDatabaseWrapper.ensure_connection = refuse


def _configure_logging() -> None:
    # Concise lines on stderr; the libraries' request-by-request chatter stays out.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("CLOACINA_LOG_LEVEL", "INFO"))
    for noisy in ("httpx", "httpcore", "websockets", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class Command(BaseCommand):
    help = "Run a DB-less execution agent: register, heartbeat, take work until SIGTERM, drain."
    requires_system_checks: list = []  # the checks would import nothing useful and may touch the DB

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--server",
            action="append",
            default=[],
            help=f"server URL (or ${ENV_SERVER_URL}); repeat it, or separate URLs with commas, "
            "to name several replicas: the agent fails over between them",
        )
        parser.add_argument("--api-key", help=f"agent API key (or ${ENV_API_KEY})")
        parser.add_argument(
            "--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY, help="task slots"
        )
        parser.add_argument("--target-triple", help="default: this host's triple")
        parser.add_argument("--name", help="default: <hostname>-<pid>")
        parser.add_argument("--tags", default="", help="comma-separated")
        parser.add_argument("--capabilities", default="", help="comma-separated")
        parser.add_argument(
            "--exclusive",
            action="store_true",
            help="take only tasks that name this agent, one of its tags or a capability",
        )
        parser.add_argument(
            "--cache-dir", help="unpacked packages (default $CLOACINA_HOME/agent-cache)"
        )
        parser.add_argument("--cache-max-mb", type=int, default=DEFAULT_CACHE_MAX_MB)
        parser.add_argument(
            "--ca-cert", help=f"PEM CA to trust for an https:// server (or ${ENV_CA_CERT})"
        )
        parser.add_argument(
            "--client-cert", help=f"PEM client certificate for mutual TLS (or ${ENV_CLIENT_CERT})"
        )
        parser.add_argument("--client-key", help=f"PEM key of --client-cert (or ${ENV_CLIENT_KEY})")

    def handle(self, *args, **options) -> None:
        install_db_guard()
        _configure_logging()
        config = self._config(options)
        try:  # uvloop unless CLOACINA_EVENT_LOOP=asyncio (agents/protocol/event_loop.py)
            new_loop = loop_factory()
        except EventLoopChoiceError as exc:
            raise CommandError(str(exc), returncode=2) from None
        # A local import, after the guard: nothing the agent loads may sneak a connection.
        from agents.runtime.agent import Agent

        agent = Agent(config)
        # Django and the agent's libraries are loaded and live as long as the process: no
        # full collection walks them again (agents/protocol/heap.py says why).
        freeze_startup_heap()
        with asyncio.Runner(loop_factory=new_loop) as runner:
            code = runner.run(_run(agent))
        if code:
            sys.exit(code)

    def _config(self, options: dict) -> AgentConfig:
        server = ",".join(options["server"] or []) or os.environ.get(ENV_SERVER_URL, "")
        api_key = options["api_key"] or os.environ.get(ENV_API_KEY, "")
        if not server:
            raise CommandError(f"--server (or {ENV_SERVER_URL}) is required", returncode=2)
        if not api_key:
            raise CommandError(f"--api-key (or {ENV_API_KEY}) is required", returncode=2)
        try:
            servers = server_list(server)
        except ValueError as exc:
            raise CommandError(f"--server: {exc}", returncode=2) from None
        server = servers[0]
        triple = options["target_triple"] or host_triple()
        try:
            parse_triple(triple)
        except TripleError as exc:
            raise CommandError(f"--target-triple: {exc}", returncode=2) from None
        if options["max_concurrency"] < 1:
            raise CommandError("--max-concurrency must be at least 1", returncode=2)
        if options["cache_max_mb"] < 1:
            raise CommandError("--cache-max-mb must be at least 1", returncode=2)
        wire_format = os.environ.get(ENV_WIRE_FORMAT) or DEFAULT_AGENT_FORMAT
        if wire_format == ACCEPT_ANY:  # the server's setting in a shared environment
            wire_format = DEFAULT_AGENT_FORMAT
        if wire_format not in SUPPORTED_FORMATS:
            raise CommandError(
                f"{ENV_WIRE_FORMAT} must be one of {', '.join(SUPPORTED_FORMATS)}, got {wire_format!r}",
                returncode=2,
            )
        name = (options["name"] or default_name()).strip()
        if not name:
            raise CommandError("--name must not be empty", returncode=2)
        cache_dir = options["cache_dir"]
        tls = _tls(options, server)
        return AgentConfig(
            server_url=server,
            api_key=api_key,
            name=name,
            target_triple=triple,
            cache_dir=Path(cache_dir) if cache_dir else default_cache_dir(),
            cache_max_bytes=options["cache_max_mb"] * 1024 * 1024,
            max_concurrency=options["max_concurrency"],
            tags=split_list(options["tags"]),
            capabilities=split_list(options["capabilities"]),
            exclusive=bool(options.get("exclusive")),
            wire_format=wire_format,
            tls=tls,
            protocol_version=_protocol_version(),
            servers=servers,
        )


def _tls(options: dict, server: str) -> AgentTLS:
    """The TLS files (flag > environment), loaded once now so a bad one is a clear exit 2."""

    def path(flag: str, env: str) -> Path | None:
        value = options.get(flag) or os.environ.get(env, "")
        return Path(value).expanduser() if value else None

    tls = AgentTLS(
        ca_cert=path("ca_cert", ENV_CA_CERT),
        client_cert=path("client_cert", ENV_CLIENT_CERT),
        client_key=path("client_key", ENV_CLIENT_KEY),
    )
    if not server.startswith("https:"):
        if tls != AgentTLS():
            log.warning("the server URL is http://: --ca-cert/--client-cert/--client-key unused")
        return tls
    try:
        client_context(tls)
    except TLSConfigError as exc:
        raise CommandError(str(exc), returncode=2) from None
    return tls


def _protocol_version() -> int:
    raw = os.environ.get(ENV_PROTOCOL_VERSION_OVERRIDE, "")
    if not raw:
        return PROTOCOL_VERSION
    try:
        return int(raw)
    except ValueError:
        raise CommandError(
            f"{ENV_PROTOCOL_VERSION_OVERRIDE} must be an integer, got {raw!r}", returncode=2
        ) from None


async def _run(agent) -> int:
    loop = asyncio.get_running_loop()
    log.info("event loop: %s", running_loop_kind(loop))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.on_signal, sig.name)
    return await agent.run()
