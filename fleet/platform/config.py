"""Server configuration, read in one place.

Precedence: command-line flag > environment variable > ``[server]`` table of
``$CLOACINA_HOME/config.toml`` > built-in default.  Flags are applied by the
command that parses them through :func:`apply_overrides`; everything else
reads :func:`get_config`.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from agents.protocol.event_loop import DEFAULT as DEFAULT_EVENT_LOOP
from agents.protocol.event_loop import ENV_EVENT_LOOP, EventLoopChoiceError
from agents.protocol.event_loop import parse_choice as parse_event_loop


class ConfigError(ValueError):
    """A configuration value is missing, malformed or out of range."""


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise ConfigError(f"{name} must be true or false, got {raw!r}")


def _parse_int(name: str, raw: str, minimum: int = 0) -> int:
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


def _parse_float(name: str, raw: str, minimum: float = 0.0) -> float:
    try:
        value = float(str(raw).strip())
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class Setting:
    """One knob: its environment variable, config.toml key, type and default."""

    attr: str
    env: str
    toml_key: str
    kind: type
    default: Any
    minimum: float = 0


# Room above the largest package or context for the rest of a request body (multipart
# boundaries and headers, the JSON around a context).
REQUEST_MARGIN_BYTES = 1024 * 1024

# How long a draining agent may take to finish its in-flight work: drained through the
# API/console, it is evicted after this; stopped by an actuator, it is killed after this.
# The control plane reads the same Setting (fleet/control/actuators/settings.py).
AGENT_DRAIN_TIMEOUT = Setting(
    "agent_drain_timeout_s",
    "CLOACINA_AGENT_DRAIN_TIMEOUT_S",
    "agent_drain_timeout_s",
    float,
    300.0,
    0.1,
)

SETTINGS: tuple[Setting, ...] = (
    Setting("default_executor", "CLOACINA_DEFAULT_EXECUTOR", "default_executor", str, "default"),
    Setting("fleet_actuator", "CLOACINA_FLEET_ACTUATOR", "fleet_actuator", str, "none"),
    Setting("default_max_agents", "CLOACINA_DEFAULT_MAX_AGENTS", "default_max_agents", int, 4),
    Setting("initial_agents", "CLOACINA_INITIAL_AGENTS", "initial_agents", int, 0),
    # Agents that are not dead (live or draining) one tenant may hold, hand-run and
    # actuator-started together: "auto" or a positive integer (see registered_agents_cap).
    Setting(
        "max_registered_agents",
        "CLOACINA_MAX_REGISTERED_AGENTS",
        "max_registered_agents",
        str,
        "auto",
    ),
    # Registration storms (docs/scaling.md): registrations per API key and per tenant in
    # any sliding minute (0 = unlimited), and registrations + socket opens one server
    # process admits per second (0 = unlimited); past each, 429 / close 4013 with a wait.
    Setting(
        "registrations_per_key_per_minute",
        "CLOACINA_AGENT_REGISTRATIONS_PER_KEY_PER_MINUTE",
        "agent_registrations_per_key_per_minute",
        int,
        600,
    ),
    Setting(
        "registrations_per_tenant_per_minute",
        "CLOACINA_AGENT_REGISTRATIONS_PER_TENANT_PER_MINUTE",
        "agent_registrations_per_tenant_per_minute",
        int,
        0,
    ),
    Setting(
        "agent_admissions_per_s",
        "CLOACINA_AGENT_ADMISSIONS_PER_S",
        "agent_admissions_per_s",
        float,
        500.0,
    ),
    Setting(
        "heartbeat_interval_s",
        "CLOACINA_AGENT_HEARTBEAT_INTERVAL_S",
        "agent_heartbeat_interval_s",
        float,
        15.0,
        0.05,
    ),
    Setting(
        "liveness_misses", "CLOACINA_AGENT_LIVENESS_MISSES", "agent_liveness_misses", int, 3, 1
    ),
    Setting("autoscale", "CLOACINA_AUTOSCALE", "autoscale", bool, True),
    Setting(
        "autoscale_interval_s",
        "CLOACINA_AUTOSCALE_INTERVAL_S",
        "autoscale_interval_s",
        float,
        30.0,
        0.1,
    ),
    Setting(
        "autoscale_up_threshold",
        "CLOACINA_AUTOSCALE_UP_THRESHOLD",
        "autoscale_up_threshold",
        float,
        0.8,
    ),
    Setting(
        "autoscale_down_threshold",
        "CLOACINA_AUTOSCALE_DOWN_THRESHOLD",
        "autoscale_down_threshold",
        float,
        0.2,
    ),
    Setting("autoscale_floor", "CLOACINA_AUTOSCALE_FLOOR", "autoscale_floor", int, 0),
    Setting(
        "autoscale_cooldown_s", "CLOACINA_AUTOSCALE_COOLDOWN_S", "autoscale_cooldown_s", float, 60.0
    ),
    Setting("worker_processes", "CLOACINA_WORKER_PROCESSES", "worker_processes", int, 4, 1),
    # Most PostgreSQL connections one server process holds (0 = sized from worker_processes).
    Setting("db_pool_max", "CLOACINA_DB_POOL_MAX", "db_pool_max", int, 0),
    Setting("scheduler_poll_s", "CLOACINA_SCHEDULER_POLL_S", "scheduler_poll_s", float, 1.0, 0.01),
    Setting("wire_format", "CLOACINA_WIRE_FORMAT", "wire_format", str, "auto"),
    # The server's asyncio loop: uvloop where it imports, or the standard library's
    # (agents/protocol/event_loop.py; runagent reads the same environment variable).
    Setting("event_loop", ENV_EVENT_LOOP, "event_loop", str, DEFAULT_EVENT_LOOP),
    Setting(
        "outbox_redeliver_s", "CLOACINA_OUTBOX_REDELIVER_S", "outbox_redeliver_s", float, 10.0, 0.1
    ),
    # Pushes of one packet to one agent that no confirmation answered before the run is
    # declared lost (fleet/executors/fleet/delivery/redelivery.py): a re-push is never silently endless.
    Setting("outbox_max_pushes", "CLOACINA_OUTBOX_MAX_PUSHES", "outbox_max_pushes", int, 5, 1),
    # The per-agent circuit breaker (fleet/executors/fleet/state/breaker.py, seed 001's
    # "5 failures / 30 s reset"): consecutive push failures, refusals or result timeouts that
    # open it, its first cool-off, and the most a cool-off doubles to on re-opening.
    Setting("breaker_failures", "CLOACINA_BREAKER_FAILURES", "breaker_failures", int, 5, 1),
    Setting(
        "breaker_cooloff_s", "CLOACINA_BREAKER_COOLOFF_S", "breaker_cooloff_s", float, 30.0, 0.1
    ),
    Setting(
        "breaker_max_cooloff_s",
        "CLOACINA_BREAKER_MAX_COOLOFF_S",
        "breaker_max_cooloff_s",
        float,
        300.0,
        0.1,
    ),
    Setting(
        "outbox_retention_s", "CLOACINA_OUTBOX_RETENTION_S", "outbox_retention_s", float, 3600.0
    ),
    Setting(
        "max_package_bytes",
        "CLOACINA_MAX_PACKAGE_BYTES",
        "max_package_bytes",
        int,
        50 * 1024 * 1024,
        1,
    ),
    # What validating an upload may read and spend (artifacts/store/validation.py): tenant input
    # is parsed (TOML, Python's ast), and a few KB of gzip can hold megabytes of source.
    Setting(
        "max_manifest_bytes",
        "CLOACINA_MAX_MANIFEST_BYTES",
        "max_manifest_bytes",
        int,
        1024 * 1024,
        1,
    ),
    Setting(
        "max_module_source_bytes",
        "CLOACINA_MAX_MODULE_SOURCE_BYTES",
        "max_module_source_bytes",
        int,
        1024 * 1024,
        1,
    ),
    Setting("max_tasks", "CLOACINA_MAX_TASKS", "max_tasks", int, 5000, 1),
    # Address space of the child process that parses a package's task modules; below 64 MiB
    # the interpreter itself may not start.
    Setting(
        "validation_memory_bytes",
        "CLOACINA_VALIDATION_MEMORY_BYTES",
        "validation_memory_bytes",
        int,
        256 * 1024 * 1024,
        64 * 1024 * 1024,
    ),
    # Bytes of packages and per-target builds a tenant may store (0 = unlimited); a tenant's
    # own storage_quota_bytes, when set, wins.
    Setting(
        "tenant_storage_bytes",
        "CLOACINA_TENANT_STORAGE_BYTES",
        "tenant_storage_bytes",
        int,
        1024 * 1024 * 1024,
    ),
    Setting(
        "max_context_bytes",
        "CLOACINA_MAX_CONTEXT_BYTES",
        "max_context_bytes",
        int,
        16 * 1024 * 1024,
        1,
    ),
    # Server-side builds (POST .../builds, artifacts/builds/runner.py): most running at once
    # over every server, and the most bytes one build's pip may download.
    Setting("build_concurrency", "CLOACINA_BUILD_CONCURRENCY", "build_concurrency", int, 2, 1),
    Setting(
        "max_build_download_bytes",
        "CLOACINA_MAX_BUILD_DOWNLOAD_BYTES",
        "max_build_download_bytes",
        int,
        100 * 1024 * 1024,
        1,
    ),
    # Unfinished tasks a tenant may have before new executions get 429 (0 = unlimited);
    # a tenant's own max_backlog, when set, wins.
    Setting("max_backlog", "CLOACINA_MAX_BACKLOG", "max_backlog", int, 0),
    # Cron schedules (fleet/schedules/, docs/schedules.md): how often every server looks for
    # due schedules; how late a fire time may be and still run as on time (later ones are
    # downtime, handled by the schedule's catchup policy); most missed times catchup="all" runs.
    Setting("schedule_tick_s", "CLOACINA_SCHEDULE_TICK_S", "schedule_tick_s", float, 1.0, 0.05),
    Setting("schedule_grace_s", "CLOACINA_SCHEDULE_GRACE_S", "schedule_grace_s", float, 10.0),
    Setting(
        "schedule_catchup_max",
        "CLOACINA_SCHEDULE_CATCHUP_MAX",
        "schedule_catchup_max",
        int,
        100,
        1,
    ),
    # Fire rows older than this are deleted (0 = kept for ever): a per-second schedule
    # records 86,400 a day.
    Setting(
        "schedule_fire_retention_s",
        "CLOACINA_SCHEDULE_FIRE_RETENTION_S",
        "schedule_fire_retention_s",
        float,
        30 * 24 * 3600.0,
    ),
    # Task logs (docs/executors.md, "Task logs"): the last bytes of each attempt's output
    # kept (the agent reads the same variable); logs older than this many days are pruned
    # (0 = kept for ever).
    Setting("task_log_bytes", "CLOACINA_TASK_LOG_BYTES", "task_log_bytes", int, 256 * 1024, 1024),
    Setting(
        "task_log_retention_days",
        "CLOACINA_TASK_LOG_RETENTION_DAYS",
        "task_log_retention_days",
        float,
        14.0,
    ),
    AGENT_DRAIN_TIMEOUT,
    Setting("secret_key", "CLOACINA_SECRET_KEY", "secret_key", str, ""),
    # TLS (cloacina_site/tls.py): empty = plain HTTP; a client CA turns on mutual TLS.
    Setting("tls_cert", "CLOACINA_TLS_CERT", "tls_cert", str, ""),
    Setting("tls_key", "CLOACINA_TLS_KEY", "tls_key", str, ""),
    Setting("tls_client_ca", "CLOACINA_TLS_CLIENT_CA", "tls_client_ca", str, ""),
    Setting("debug", "CLOACINA_DEBUG", "debug", bool, False),
    # The HTTP layer (cloacina_site/web_security.py).  Host names the server answers to,
    # comma-separated ("*" = any; loopback names are always accepted).
    Setting("allowed_hosts", "CLOACINA_ALLOWED_HOSTS", "allowed_hosts", str, "*"),
    # Strict-Transport-Security max-age sent over TLS (0 = no HSTS header).
    Setting("hsts_seconds", "CLOACINA_HSTS_SECONDS", "hsts_seconds", int, 31536000),
    # Failed console/admin logins before a username, or an address, is locked out.
    Setting(
        "login_failure_limit", "CLOACINA_LOGIN_FAILURE_LIMIT", "login_failure_limit", int, 5, 1
    ),
    Setting("login_lockout_s", "CLOACINA_LOGIN_LOCKOUT_S", "login_lockout_s", int, 900, 1),
    # How long a server process reuses a verified API key (fleet/platform/key_cache.py):
    # a key revoked on another server process stops working within this (at most 60 s).
    Setting("auth_cache_ttl_s", "CLOACINA_AUTH_CACHE_TTL_S", "auth_cache_ttl_s", float, 5.0),
    # Seconds an HTTP connection may stay idle between requests before the server closes
    # it (cloacina_site/daphne_limits.py): each agent's REST connection, idle once its
    # socket is up, would otherwise hold server memory for good.
    Setting("http_keepalive_s", "CLOACINA_HTTP_KEEPALIVE_S", "http_keepalive_s", float, 30.0, 0.1),
    # Bearer token /metrics requires (empty = open, as before).
    Setting("metrics_token", "CLOACINA_METRICS_TOKEN", "metrics_token", str, ""),
)


# Executor keys the server itself registers (fleet/executors/registry.py): a configured
# executor may not take one.
BUILTIN_EXECUTOR_KEYS = ("default", "fleet")
ENV_EXECUTORS = "CLOACINA_EXECUTORS"
# A key becomes a metrics label and a CLI value: short, lower-case, no spaces.
_EXECUTOR_KEY = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
# "package.module:Class" or "package.module.Class".
_CLASS_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*([:.][A-Za-z_]\w*)$")


@dataclass(frozen=True)
class ExecutorSpec:
    """One configured executor: the class to load and the options it is built with.

    ``source`` names where it was given ("[executors.gpu] in config.toml" or
    "CLOACINA_EXECUTORS[gpu]"), so every boot error can point at the line to fix.
    """

    key: str
    class_path: str
    options: dict[str, Any]
    source: str

    @property
    def module_and_name(self) -> tuple[str, str]:
        """``class_path`` split into the module to import and the attribute to read."""
        if ":" in self.class_path:
            module, _, name = self.class_path.partition(":")
        else:
            module, _, name = self.class_path.rpartition(".")
        return module, name

    def error(self, problem: str) -> ConfigError:
        """A one-line boot error naming this executor's key and where it was configured."""
        return ConfigError(f"executor {self.key!r} ({self.source}): {problem}")


@dataclass(frozen=True)
class Config:
    """The effective server configuration (see README's configuration table)."""

    home: Path
    database_url: str | None
    default_executor: str = "default"
    fleet_actuator: str = "none"
    default_max_agents: int = 4
    initial_agents: int = 0
    max_registered_agents: str = "auto"
    registrations_per_key_per_minute: int = 600
    registrations_per_tenant_per_minute: int = 0
    agent_admissions_per_s: float = 500.0
    heartbeat_interval_s: float = 15.0
    liveness_misses: int = 3
    autoscale: bool = True
    autoscale_interval_s: float = 30.0
    autoscale_up_threshold: float = 0.8
    autoscale_down_threshold: float = 0.2
    autoscale_floor: int = 0
    autoscale_cooldown_s: float = 60.0
    worker_processes: int = 4
    db_pool_max: int = 0
    scheduler_poll_s: float = 1.0
    wire_format: str = "auto"  # accept json and msgpack agents (agents/protocol/wire.py)
    event_loop: str = DEFAULT_EVENT_LOOP  # uvloop | asyncio (agents/protocol/event_loop.py)
    outbox_redeliver_s: float = 10.0
    outbox_max_pushes: int = 5
    breaker_failures: int = 5
    breaker_cooloff_s: float = 30.0
    breaker_max_cooloff_s: float = 300.0
    outbox_retention_s: float = 3600.0
    max_package_bytes: int = 50 * 1024 * 1024
    max_manifest_bytes: int = 1024 * 1024
    max_module_source_bytes: int = 1024 * 1024
    max_tasks: int = 5000
    validation_memory_bytes: int = 256 * 1024 * 1024
    tenant_storage_bytes: int = 1024 * 1024 * 1024
    max_context_bytes: int = 16 * 1024 * 1024
    build_concurrency: int = 2
    max_build_download_bytes: int = 100 * 1024 * 1024
    max_backlog: int = 0
    schedule_tick_s: float = 1.0
    schedule_grace_s: float = 10.0
    schedule_catchup_max: int = 100
    schedule_fire_retention_s: float = 30 * 24 * 3600.0
    task_log_bytes: int = 256 * 1024
    task_log_retention_days: float = 14.0
    agent_drain_timeout_s: float = 300.0
    secret_key: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    debug: bool = False
    allowed_hosts: str = "*"
    hsts_seconds: int = 31536000
    login_failure_limit: int = 5
    login_lockout_s: int = 900
    metrics_token: str = ""
    auth_cache_ttl_s: float = 5.0
    http_keepalive_s: float = 30.0
    # Executors registered from configuration ([executors] / CLOACINA_EXECUTORS), by key.
    executors: dict[str, ExecutorSpec] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    @property
    def max_request_bytes(self) -> int:
        """The largest request body any endpoint accepts: past it, 413 before Django runs."""
        return max(self.max_package_bytes, self.max_context_bytes) + REQUEST_MARGIN_BYTES

    @property
    def allowed_host_list(self) -> list[str]:
        """``allowed_hosts`` split and checked (see :func:`parse_allowed_hosts`)."""
        return parse_allowed_hosts(self.allowed_hosts)

    def registered_agents_cap(self, effective_limit: int) -> int:
        """How many agents that are not dead a tenant with this effective limit may hold.

        ``auto``: max(64, 4 × the limit), room for hand-run agents and for a rolling
        restart's overlap.  A number N: max(N, the limit), so an actuator can always start
        every agent desired_count asks for, whatever N is.
        """
        fixed = parse_max_registered_agents(self.max_registered_agents)
        if fixed is None:
            return max(
                AUTO_REGISTERED_AGENTS_MIN, AUTO_REGISTERED_AGENTS_PER_LIMIT * effective_limit
            )
        return max(fixed, effective_limit)

    @property
    def liveness_window_s(self) -> float:
        """Seconds without a heartbeat after which an agent is declared dead."""
        return self.heartbeat_interval_s * self.liveness_misses


# CLOACINA_MAX_REGISTERED_AGENTS=auto: max(AUTO_REGISTERED_AGENTS_MIN, PER_LIMIT × limit).
AUTO_REGISTERED_AGENTS_MIN = 64
AUTO_REGISTERED_AGENTS_PER_LIMIT = 4


def parse_max_registered_agents(raw: str) -> int | None:
    """``CLOACINA_MAX_REGISTERED_AGENTS``: None for ``auto``, else a positive integer."""
    value = raw.strip().lower()
    if value == "auto":
        return None
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ConfigError(
            "CLOACINA_MAX_REGISTERED_AGENTS (max_registered_agents) must be auto or a "
            f"positive integer, got {raw!r}"
        )
    return number


# A host name (optionally with a leading dot: the domain and its subdomains), an IPv4
# address, a bracketed IPv6 address, or "*".
_HOST = re.compile(
    r"^(\*|\.?[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*|\[[0-9A-Fa-f:.]+\])$"
)


def parse_allowed_hosts(raw: str) -> list[str]:
    """``CLOACINA_ALLOWED_HOSTS`` as Django's ALLOWED_HOSTS; ConfigError naming a bad entry."""
    hosts = [part.strip() for part in raw.split(",")]
    if not any(hosts):
        raise ConfigError("CLOACINA_ALLOWED_HOSTS must name at least one host (or *)")
    for host in hosts:
        if not _HOST.match(host):
            raise ConfigError(
                f"CLOACINA_ALLOWED_HOSTS: {host!r} is not a host name, IP address or * "
                "(no scheme, port or path; separate hosts with commas)"
            )
    return hosts


def cloacina_home() -> Path:
    return Path(os.environ.get("CLOACINA_HOME") or "~/.cloacina").expanduser()


def _read_toml_file(home: Path) -> dict:
    path = home / "config.toml"
    if not path.exists():
        return {}
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def _read_toml(home: Path) -> dict:
    path = home / "config.toml"
    server = _read_toml_file(home).get("server", {})
    if not isinstance(server, dict):
        raise ConfigError(f"{path}: [server] must be a table")
    return server


def _coerce(setting: Setting, raw: Any, source: str) -> Any:
    if source == "environment":
        name = setting.env
    elif source == "config.toml":
        name = f"{setting.toml_key} in config.toml"
    else:  # a command-line flag: its own name
        name = source
    if setting.kind is bool:
        return raw if isinstance(raw, bool) else _parse_bool(name, str(raw))
    if setting.kind is int:
        return _parse_int(name, raw, int(setting.minimum))
    if setting.kind is float:
        return _parse_float(name, raw, float(setting.minimum))
    return str(raw).strip()


def parse_flag(attr: str, raw: str | None, flag: str) -> Any:
    """A command-line flag's value for the setting ``attr``, checked like its env variable
    (same type and minimum) but named after ``flag`` in the error; ``None``: not given."""
    if raw is None:
        return None
    setting = next((s for s in SETTINGS if s.attr == attr), None)
    if setting is None:
        raise ConfigError(f"unknown configuration key: {attr!r}")
    return _coerce(setting, raw, flag)


def read_settings(
    settings: tuple[Setting, ...], environ: dict | None = None
) -> tuple[Path, dict[str, Any]]:
    """``$CLOACINA_HOME`` and the values of ``settings`` given in the environment (first) or
    the ``[server]`` table of its config.toml, checked; settings given in neither are left out."""
    env = os.environ if environ is None else environ
    home = Path(env.get("CLOACINA_HOME") or "~/.cloacina").expanduser()
    toml = _read_toml(home)
    values: dict[str, Any] = {}
    for setting in settings:
        if env.get(setting.env) not in (None, ""):
            values[setting.attr] = _coerce(setting, env[setting.env], "environment")
        elif setting.toml_key in toml:
            values[setting.attr] = _coerce(setting, toml[setting.toml_key], "config.toml")
    return home, values


def read_executor_specs(home: Path, environ: dict | None = None) -> dict[str, ExecutorSpec]:
    """The executors configured in config.toml's ``[executors]`` table and in
    ``CLOACINA_EXECUTORS`` (JSON of the same shape), checked; the environment's entry wins
    for a key given in both.  Each entry is ``{class = "module:Class", options = {...}}``.

    Only the shape is checked here (the platform layer knows no executor): the registry
    (fleet/executors/registry.py) imports each class and builds it at boot.
    """
    env = os.environ if environ is None else environ
    tables: list[tuple[dict, str]] = []
    from_toml = _read_toml_file(home).get("executors", {})
    if not isinstance(from_toml, dict):
        raise ConfigError(f"{home / 'config.toml'}: [executors] must be a table")
    tables.append((from_toml, "config.toml"))
    raw_env = env.get(ENV_EXECUTORS, "")
    if raw_env.strip():
        try:
            from_env = json.loads(raw_env)
        except ValueError as exc:
            raise ConfigError(f"{ENV_EXECUTORS} must be a JSON object: {exc}") from None
        if not isinstance(from_env, dict):
            raise ConfigError(f"{ENV_EXECUTORS} must be a JSON object of executor key → entry")
        tables.append((from_env, ENV_EXECUTORS))
    specs: dict[str, ExecutorSpec] = {}
    for table, origin in tables:
        for key, entry in table.items():
            source = (
                f"[executors.{key}] in config.toml"
                if origin == "config.toml"
                else f"{ENV_EXECUTORS}[{key}]"
            )
            specs[key] = _executor_spec(str(key), entry, source)
    return specs


def _executor_spec(key: str, entry: Any, source: str) -> ExecutorSpec:
    def problem(text: str) -> ConfigError:
        return ConfigError(f"executor {key!r} ({source}): {text}")

    if key in BUILTIN_EXECUTOR_KEYS:
        raise problem(
            f"the key is built in ({', '.join(BUILTIN_EXECUTOR_KEYS)}); choose another name"
        )
    if not _EXECUTOR_KEY.match(key):
        raise problem("a key is 1-63 characters: a-z first, then a-z, 0-9, '_' or '-'")
    if not isinstance(entry, dict):
        raise problem('must be a table: {class = "module:Class", options = {...}}')
    unknown = sorted(set(entry) - {"class", "options"})
    if unknown:
        raise problem(f"unknown field(s) {', '.join(unknown)} (expected class and options)")
    class_path = entry.get("class")
    if not isinstance(class_path, str) or not _CLASS_PATH.match(class_path.strip()):
        raise problem(
            f'class must be a dotted path such as "package.module:Class", got {class_path!r}'
        )
    options = entry.get("options", {})
    if not isinstance(options, dict) or not all(isinstance(name, str) for name in options):
        raise problem("options must be a table of option name → value")
    return ExecutorSpec(key, class_path.strip(), dict(options), source)


def load_config(environ: dict | None = None) -> Config:
    """Build the configuration from env, config.toml and defaults (no flags)."""
    env = os.environ if environ is None else environ
    home, given = read_settings(SETTINGS, env)
    values = {setting.attr: setting.default for setting in SETTINGS} | given
    config = Config(
        home=home,
        database_url=env.get("DATABASE_URL") or None,
        executors=read_executor_specs(home, env),
        **values,
    )
    _validate(config)
    return config


def _validate(config: Config) -> None:
    if config.autoscale_down_threshold > config.autoscale_up_threshold:
        raise ConfigError(
            "CLOACINA_AUTOSCALE_DOWN_THRESHOLD must not exceed CLOACINA_AUTOSCALE_UP_THRESHOLD"
        )
    parse_allowed_hosts(config.allowed_hosts)
    parse_max_registered_agents(config.max_registered_agents)
    if config.wire_format not in ("auto", "json", "msgpack"):
        raise ConfigError(
            f"CLOACINA_WIRE_FORMAT must be auto, json or msgpack, got {config.wire_format!r}"
        )
    try:
        parse_event_loop(config.event_loop)
    except EventLoopChoiceError as exc:
        raise ConfigError(str(exc)) from None


_config: Config | None = None


def get_config() -> Config:
    """The process-wide configuration (loaded once, then flag overrides applied)."""
    global _config
    if _config is None:
        _config = load_config()
    return _config


def apply_overrides(**flags: Any) -> Config:
    """Apply command-line flags (highest precedence); ``None`` means not given."""
    global _config
    given = {k: v for k, v in flags.items() if v is not None}
    known = {f.name for f in fields(Config)}
    unknown = set(given) - known
    if unknown:
        raise ConfigError(f"unknown configuration keys: {sorted(unknown)}")
    _config = replace(get_config(), **given)
    _validate(_config)
    return _config


def reset_config() -> None:
    """Forget the loaded configuration (tests change the environment)."""
    global _config
    _config = None
