"""Real processes for the end-to-end tests: `serve`, `runagent` (plain or gated), the CLI.

Processes run against the test database (pytest-django's ``test_cloacina`` on
the same PostgreSQL), so a test using them needs
``@pytest.mark.django_db(transaction=True)`` (data must be committed to be
seen) and must stop them before pytest-django flushes the tables:
:class:`Processes` used from a fixture that depends on ``transactional_db``
does both.

    @pytest.fixture
    def procs(transactional_db, tmp_path):
        with Processes(tmp_path) as procs:
            yield procs
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import httpx

REPO = Path(__file__).resolve().parents[2]
MANAGE = str(REPO / "manage.py")
READY_LINE = re.compile(r"Cloacina server ready: console at (http://\S+?)/console/")
STOP_GRACE_S = 15.0
AGENT_READY = re.compile(r"delivery socket open")
# The agent tests redeliver unacknowledged packets after 2 s instead of the default.
SHORT_REDELIVERY = {"CLOACINA_OUTBOX_REDELIVER_S": "2"}
GATED_RUNAGENT = Path(__file__).resolve().parent / "gated_runagent.py"

# Heartbeats are short (0.5 s x 3 misses) so an agent killed in a test is evicted in about
# two seconds.
FLEET_ENV = {
    "CLOACINA_DEFAULT_EXECUTOR": "fleet",
    "CLOACINA_AGENT_HEARTBEAT_INTERVAL_S": "0.5",
    "CLOACINA_AGENT_LIVENESS_MISSES": "3",
}


def current_database_url() -> str:
    """A postgresql:// URL for the database this test process is connected to."""
    from django.db import connection

    s = connection.settings_dict
    user = quote(s.get("USER") or "", safe="")
    password = quote(s.get("PASSWORD") or "", safe="")
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    host = s.get("HOST") or ""
    name = quote(s["NAME"], safe="")
    if host.startswith("/"):  # a Unix socket directory (the embedded server)
        return f"postgresql://{auth}/{name}?host={quote(host, safe='/')}"
    port = f":{s['PORT']}" if s.get("PORT") else ""
    return f"postgresql://{auth}{host}{port}/{name}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_http(url: str, timeout: float = 30.0, process: ManagedProcess | None = None) -> None:
    """Poll ``url`` until it answers 200; fail early (with the log) if ``process`` exits."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"{process.name} exited with {process.poll()}:\n{process.tail()}")
        try:
            response = httpx.get(url, timeout=2.0)
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.05)
    tail = process.tail() if process else ""
    raise AssertionError(f"{url} not ready after {timeout}s ({last})\n{tail}")


class ManagedProcess:
    """A child process in its own session, its stdout+stderr going to a log file."""

    def __init__(self, name: str, args: list[str], env: dict, log_path: Path) -> None:
        self.name = name
        self.args = args
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.popen = subprocess.Popen(
            args,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its worker processes share its group: one kill reaches all
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    def wait_for_output(self, pattern: re.Pattern, timeout: float = 30.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = pattern.search(self.output())
            if match:
                return match
            if self.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.poll()}:\n{self.tail()}")
            time.sleep(0.05)
        raise AssertionError(f"{self.name}: no {pattern.pattern!r} after {timeout}s\n{self.tail()}")

    def signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    @property
    def is_server(self) -> bool:
        """Whether this is a `serve` (which agents talk to, so it is stopped after them)."""
        return self.args[1:3] == [MANAGE, "serve"]

    def stop(self, grace_s: float = STOP_GRACE_S) -> int:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL the whole process group."""
        self.terminate()
        return self.reap(time.monotonic() + grace_s)

    def terminate(self) -> None:
        """SIGTERM, if it is still running: the start of a clean stop."""
        self.signal(signal.SIGTERM)

    def reap(self, deadline: float) -> int:
        """Wait for the exit until ``deadline`` (time.monotonic()), then SIGKILL the whole
        process group; the exit code."""
        if self.poll() is None:
            try:
                self.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill_group()
        code = self.popen.wait(5)
        self._log.close()
        return code

    def kill_group(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class ServeHandle:
    def __init__(self, process: ManagedProcess, url: str) -> None:
        self.process = process
        self.url = url

    def api(self, path: str) -> str:
        return f"{self.url}/api/v1{path}"


class Processes:
    """Starts processes against the test database and stops every one of them on exit."""

    def __init__(self, tmp_path: Path, **env: str) -> None:
        self.tmp_path = tmp_path
        self.home = tmp_path / "home"
        self.home.mkdir(exist_ok=True)
        self.extra_env = env
        self.processes: list[ManagedProcess] = []

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def stop_all(self) -> None:
        """Stop every process: first the agents (and any other non-server), then the servers
        they talk to.  Each group gets SIGTERM at once and one grace period together, so a
        teardown waits for its slowest process rather than for the sum of their shutdowns."""
        servers = [p for p in reversed(self.processes) if p.is_server]
        others = [p for p in reversed(self.processes) if not p.is_server]
        for group in (others, servers):
            for process in group:
                process.terminate()
            deadline = time.monotonic() + STOP_GRACE_S
            for process in group:
                process.reap(deadline)

    def env(self, **extra: str) -> dict:
        env = dict(os.environ)
        env.update(
            DATABASE_URL=current_database_url(),
            CLOACINA_HOME=str(self.home),
            DJANGO_SETTINGS_MODULE="cloacina_site.settings",
            PYTHONUNBUFFERED="1",
            CLOACINA_SCHEDULER_POLL_S="0.2",
            CLOACINA_SERVER_HEARTBEAT_S="0.5",
        )
        env.update(self.extra_env)
        env.update(extra)
        return env

    def start(
        self, args: list[str], name: str | None = None, env: dict | None = None
    ) -> ManagedProcess:
        """Start any command (``args[0]`` may be a manage.py command name)."""
        name = name or f"{args[0]}-{len(self.processes)}"
        if not args[0].startswith("/"):
            args = [sys.executable, MANAGE, *args]
        process = ManagedProcess(name, args, env or self.env(), self.tmp_path / f"{name}.log")
        self.processes.append(process)
        return process

    def serve(self, *flags: str, env: dict | None = None, timeout: float = 60.0) -> ServeHandle:
        """Start `serve` on a free port (``--port 0``) and wait until it is ready and healthy."""
        process = self.start(
            ["serve", "--port", "0", *flags], name=f"serve-{len(self.processes)}", env=env
        )
        url = process.wait_for_output(READY_LINE, timeout).group(1)
        wait_for_http(f"{url}/healthz", timeout=10.0, process=process)
        return ServeHandle(process, url)

    def manage(
        self, *args: str, input: str | None = None, env: dict | None = None, timeout: float = 60.0
    ) -> subprocess.CompletedProcess:
        """Run a manage.py command to completion; stdout and stderr captured separately."""
        return subprocess.run(
            [sys.executable, MANAGE, *args],
            cwd=REPO,
            env=env or self.env(),
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


# --- the fleet: a `serve --default-executor fleet` and real agents -------------------------


def fleet_serve(
    procs: Processes, port: int | None = None, name: str | None = None, **env_overrides: str
) -> ServeHandle:
    """Start `serve` with the fleet executor (on ``port``, else any free one)."""
    env = procs.env(**{**FLEET_ENV, **env_overrides})
    if port is None:
        return procs.serve(env=env)
    process = procs.start(["serve", "--port", str(port)], name=name or f"serve-{port}", env=env)
    url = process.wait_for_output(READY_LINE, 60).group(1)
    wait_for_http(f"{url}/healthz", timeout=10.0, process=process)
    return ServeHandle(process, url)


def start_agent(
    procs: Processes,
    server: ServeHandle | str,
    key: str,
    name: str,
    *flags: str,
    slots: int = 1,
    env: dict | None = None,
    wait: bool = True,
    gates: Path | None = None,
) -> ManagedProcess:
    """A real ``runagent`` named ``name`` with ``slots`` task slots and a cache dir of its own.

    ``flags`` are further runagent options; ``wait`` waits for its delivery socket.  With
    ``gates`` (a directory) the agent runs under tests/support/gated_runagent.py, whose
    gate files hold its outcomes and later pushes (see that module).
    """
    url = server if isinstance(server, str) else server.url
    args = [
        "runagent", "--server", url, "--api-key", key, "--name", name,
        "--max-concurrency", str(slots), "--cache-dir", str(procs.tmp_path / f"cache-{name}"),
        *flags,
    ]  # fmt: skip
    if gates is not None:
        args = [sys.executable, str(GATED_RUNAGENT), *args]
        env = {**(env or procs.env()), "CLOACINA_TEST_GATES": str(gates)}
    process = procs.start(args, name=f"agent-{name}", env=env)
    if wait:
        process.wait_for_output(AGENT_READY, 60)
    return process


def wait_exit(process: ManagedProcess, timeout: float = 30.0) -> int:
    """The process's exit code once it has exited on its own (fails with its log otherwise)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = process.poll()
        if code is not None:
            return code
        time.sleep(0.05)
    raise AssertionError(f"{process.name} still running after {timeout}s:\n{process.tail()}")


# --- the control plane: `serve --actuator process` and the agents it starts ---------------

LEADER_LINE = re.compile(r"fleet control: server (\S+) is now the leader")


def control_env(procs: Processes, **extra: str) -> dict:
    """Short intervals so a control-plane test takes seconds, not minutes."""
    settings = {
        "CLOACINA_DEFAULT_EXECUTOR": "fleet",
        "CLOACINA_FLEET_ACTUATOR": "process",
        "CLOACINA_AUTOSCALE": "false",
        "CLOACINA_AUTOSCALE_INTERVAL_S": "0.3",
        "CLOACINA_AUTOSCALE_COOLDOWN_S": "0.5",
        "CLOACINA_AGENT_HEARTBEAT_INTERVAL_S": "0.5",
        "CLOACINA_AGENT_LIVENESS_MISSES": "3",
        "CLOACINA_AGENT_MAX_CONCURRENCY": "2",
        "CLOACINA_AGENT_DRAIN_TIMEOUT_S": "30",
    }
    settings.update(extra)
    return procs.env(**settings)


def agent_logs(home: Path, lines: int = 15) -> str:
    """The tails of the logs of the agents an actuator started under ``home``."""
    out = []
    for path in sorted((home / "agents").glob("*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {path.name}\n" + "\n".join(tail))
    return "\n".join(out)


def diagnostics(procs: Processes, *serves: ServeHandle) -> Callable[[], str]:
    """A ``logs`` callable for :func:`~tests.support.waiting.wait_until`: servers and agents."""

    def render() -> str:
        parts = [f"=== {s.process.name}\n{s.process.tail(40)}" for s in serves]
        return "\n".join(parts) + "\n" + agent_logs(procs.home)

    return render
